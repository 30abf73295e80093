package app_test

import (
	"context"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/services/sender/internal/app"
)

// TestSenderAnnouncesRemovedKeys runs the sender with its removal watcher
// (KVMESH_SENDER_EVICTIONS) on a private redis-server: a save's keys are
// announced BlockStored, and a key of them deleted from Redis is announced
// BlockRemoved with the same namespace and wire hash.
func TestSenderAnnouncesRemovedKeys(t *testing.T) {
	priv := testenv.StartRedis(t).URL()
	s := newStack(t, stackOptions{engines: []string{"e1"}, workerRedis: priv, senderRedis: priv,
		config: func(c *app.Config) { c.Evictions, c.EvictionsConfigure = true, true }})
	ro, err := redis.ParseURL(priv)
	if err != nil {
		t.Fatal(err)
	}
	rc := redis.NewClient(ro)
	defer rc.Close()
	ctx := context.Background()
	marker := "kvmesh-evictions-marker@" + s.prefix + "@" + s.model.Name
	poll(t, "the removal watcher's subscription (its marker key)", func() bool { return rc.Exists(ctx, marker).Val() == 1 })

	task := s.task(t, "e1", "ev1", 0, 32, 2)
	s.publish(t, task)
	if res := s.got.result(t, task.TaskID); res.Status != "stored" {
		t.Fatalf("save %+v", res)
	}
	stored := s.got.blockStored(t, "ev1", 0, 2)
	victim := stored.Keys[1]
	if err := rc.Del(ctx, victim).Err(); err != nil {
		t.Fatal(err)
	}
	var removed contract.KVEventRecord
	poll(t, "the BlockRemoved of "+victim, func() bool {
		s.got.mu.Lock()
		defer s.got.mu.Unlock()
		for _, e := range s.got.events {
			if e.Kind() == contract.BlockRemoved && len(e.Keys()) == 1 && e.Keys()[0] == victim {
				removed = e
				return true
			}
		}
		return false
	})
	var wire uint64
	s.got.mu.Lock()
	for _, e := range s.got.events {
		if e.Kind() == contract.BlockStored && e.RequestID == "ev1" && e.Namespace == removed.Namespace {
			for i, k := range e.Keys() {
				if k == victim {
					n := 0
					for _, ev := range e.Batch.Events {
						for _, h := range ev.BlockHashes {
							if n == i {
								wire = h
							}
							n++
						}
					}
				}
			}
		}
	}
	s.got.mu.Unlock()
	ev := removed.Batch.Events[0]
	if removed.Cause != "del" || removed.Model != s.model.Name || *ev.GroupIdx != 0 || ev.BlockHashes[0] != wire || wire == 0 ||
		ev.Medium == nil || *ev.Medium != contract.MediumStore || ev.Locality == nil || *ev.Locality != contract.LocalityStore {
		t.Fatalf("BlockRemoved %+v (event %+v), want cause del, group 0, the BlockStored wire hash %#x, the store's medium and locality", removed, ev, wire)
	}
}
