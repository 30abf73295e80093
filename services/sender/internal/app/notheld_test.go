package app_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"net/http"
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/deadletter/dlqhttp"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
)

// TestSaveOfReusedBlockStoresNoWrongBytes simulates the engine preempting
// a request while its save is in flight and reusing one of its blocks: the
// task's blocks are written, then one block of group 0 is rewritten with
// another request's chunk and bytes (or evicted), then the sender gets the
// task. Group 0 is dead-lettered with block_not_held (in the result, on
// kvmesh.save.dlq, in GET /v1/dlq), group 1 is stored, the result is
// published, and not one stored byte is wrong: every key under the test's
// prefix decodes to the bytes first written for its own chunk, and none to
// the other request's.
func TestSaveOfReusedBlockStoresNoWrongBytes(t *testing.T) {
	s := newStack(t, stackOptions{engines: []string{"e1"}})
	ctx := context.Background()
	worker := s.workers["e1"]
	const reused = kvcore.BlockID(1) // group 0's second chunk: hash index 1
	cases := []struct {
		name    string
		id      string
		base    kvcore.BlockID
		preempt func(t *testing.T, task *kvcore.SaveTask) []byte // returns the bytes the block holds now, nil if none
	}{
		{"rewritten by another request", "preempt-rewrite", 0, func(t *testing.T, task *kvcore.SaveTask) []byte {
			other := make([]byte, s.model.Groups[0].BytesPerBlock)
			_, _ = rand.Read(other)
			if err := worker.Write(ctx, []dataplane.Block{{BlockRef: dataplane.BlockRef{Group: 0, Block: task.BlockTable[0][reused]},
				Identity: dataplane.Identity{Hash: randHex(32), RequestID: "other-request"}, Data: other}}); err != nil {
				t.Fatal(err)
			}
			return other
		}},
		{"evicted", "preempt-evict", 8, func(t *testing.T, task *kvcore.SaveTask) []byte {
			if n, err := worker.Evict(ctx, []dataplane.BlockRef{{Group: 0, Block: task.BlockTable[0][reused]}}); err != nil || n != 1 {
				t.Fatalf("Evict = %d, %v", n, err)
			}
			return nil
		}},
	}
	var wrong [][]byte
	var tasks []*kvcore.SaveTask
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			task := s.task(t, "e1", tc.id, 0, 64, tc.base)
			if b := tc.preempt(t, task); b != nil {
				wrong = append(wrong, b)
			}
			s.publish(t, task)

			res := s.got.result(t, task.TaskID)
			g0, g1 := groupOf(res, 0), groupOf(res, 1)
			if res.Status != "dead_lettered" || g0.Stored != 3 || g0.DeadLettered != 1 || g0.Reason != string(kvcore.ReasonBlockNotHeld) ||
				g1.Stored != 1 || g1.DeadLettered != 0 || g1.Reason != "" {
				t.Fatalf("result %+v, want group 0 dead-lettered (block_not_held, 3 stored) and group 1 stored", res)
			}
			dls := s.got.deadLetters(t, task.TaskID, 1)
			if len(dls) != 1 || dls[0].Reason != string(kvcore.ReasonBlockNotHeld) || dls[0].Group == nil || *dls[0].Group != 0 {
				t.Fatalf("dlq records %+v, want one block_not_held for group 0", dls)
			}
			var page dlqhttp.Page
			poll(t, "the dead letter in GET /v1/dlq", func() bool {
				s.do(t, http.MethodGet, "/v1/dlq?reason=block_not_held&request_id="+tc.id, "", &page)
				return len(page.Items) > 0
			})
			if e := page.Items[0]; len(page.Items) != 1 || e.Reason != kvcore.ReasonBlockNotHeld || e.Group == nil || *e.Group != 0 ||
				e.TaskID != task.TaskID || !strings.Contains(e.Detail, "no longer hold") {
				t.Fatalf("GET /v1/dlq = %+v", page.Items)
			}
			if ev := s.got.blockStored(t, tc.id, 0, 3); len(ev.Keys) != 3 || containsKey(ev.Keys, s.keys(t, task, 0)[reused]) {
				t.Fatalf("group 0 kv event keys %v: want the 3 stored, not the refused one", ev.Keys)
			}
			s.checkStored(t, task, 1)
			keys := s.keys(t, task, 0)
			if s.missing(t, keys) != 1 || s.missing(t, keys[reused:reused+1]) != 1 {
				t.Fatalf("group 0: %d of %d keys missing, want only the reused block's", s.missing(t, keys), len(keys))
			}
			s.checkStoredFrom(t, task, 0, int(reused)+1)
			tasks = append(tasks, task)
		})
	}
	if len(tasks) != len(cases) {
		t.Fatal("a case failed")
	}
	if n := s.checkEveryStoredValue(t, tasks, wrong); n != 4*len(tasks) {
		t.Fatalf("%d keys stored under the prefix, want %d (3 + 1 per task)", n, 4*len(tasks))
	}
	s.checkMetrics(t, `kvmesh_dead_letters_total{reason="block_not_held"} 2`)
}

// checkEveryStoredValue scans every key under the stack's prefix: each must
// be a key the tasks plan, decode (with the model fingerprint) to exactly
// the bytes first written for its chunk's block, and hold none of wrong.
// It returns how many keys it checked.
func (s *stack) checkEveryStoredValue(t *testing.T, tasks []*kvcore.SaveTask, wrong [][]byte) int {
	t.Helper()
	want := map[string][]byte{}
	for _, task := range tasks {
		for g := range s.model.Groups {
			items, err := kvcore.PlanSend(s.model, kvcore.KeysOf(s.model).WithPrefix(s.prefix), task, g, kvcore.Rank{})
			if err != nil {
				t.Fatal(err)
			}
			s.mu.Lock()
			for _, it := range items {
				want[it.Key] = s.written[blockKey(task.EngineID, g, it.Block)]
			}
			s.mu.Unlock()
		}
	}
	opts, err := redis.ParseURL(s.redis)
	if err != nil {
		t.Fatal(err)
	}
	rdb := redis.NewClient(opts)
	defer rdb.Close()
	ctx := context.Background()
	n := 0
	iter := rdb.Scan(ctx, 0, s.prefix+"@*", 1000).Iterator()
	for iter.Next(ctx) {
		key := iter.Val()
		if ns, ok := strings.CutSuffix(key, kvstore.StoredIndexSuffix); ok {
			checkIndex(ctx, t, rdb, ns, want) // a namespace's store times, not a value
			continue
		}
		raw, err := rdb.Get(ctx, key).Bytes()
		if err != nil {
			t.Fatalf("key %s: %v", key, err)
		}
		payload, err := dataplane.DecodeValue(s.model.Fingerprint(), raw)
		if err != nil {
			t.Fatalf("key %s does not decode: %v", key, err)
		}
		for _, w := range wrong {
			if bytes.Equal(payload, w) {
				t.Fatalf("key %s holds the other request's bytes", key)
			}
		}
		exp, ok := want[key]
		if !ok {
			t.Fatalf("key %s is no chunk of the tasks", key)
		}
		if exp == nil || !bytes.Equal(payload, exp) {
			t.Fatalf("key %s holds other bytes than its chunk's block was written with", key)
		}
		n++
	}
	if err := iter.Err(); err != nil {
		t.Fatal(err)
	}
	return n
}

func containsKey(keys []string, k string) bool {
	for _, x := range keys {
		if x == k {
			return true
		}
	}
	return false
}

// checkIndex checks the store-time index of namespace ns: every block it
// times is a chunk the tasks stored.
func checkIndex(ctx context.Context, t *testing.T, rdb *redis.Client, ns string, want map[string][]byte) {
	t.Helper()
	hashes, err := rdb.ZRange(ctx, ns+kvstore.StoredIndexSuffix, 0, -1).Result()
	if err != nil {
		t.Fatalf("index of %s: %v", ns, err)
	}
	for _, h := range hashes {
		if _, ok := want[ns+"@"+h]; !ok {
			t.Fatalf("index of %s times %s, no chunk of the tasks", ns, h)
		}
	}
}
