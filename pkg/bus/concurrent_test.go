package bus_test

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

func TestConcurrentKeepsEachKeysOrder(t *testing.T) {
	const topic, group, keys, perKey = "bus.test.lanes-order", "lanes-order", 12, 40
	e := newEnv(t)
	e.topics(topic)
	var msgs []bus.Message
	for seq := range perKey {
		for k := range keys {
			msgs = append(msgs, bus.Message{Topic: topic, Key: "key-" + strconv.Itoa(k), Value: []byte(strconv.Itoa(seq))})
		}
	}
	e.publish(e.producer(), msgs...)

	var mu sync.Mutex
	inFlight := map[string]bool{}
	var overlaps atomic.Int32
	var got seen[delivery]
	cfg := e.consumerConfig(group, topic)
	cfg.Concurrency = 4
	stop := e.run(cfg, func(_ context.Context, m bus.Received) error {
		mu.Lock()
		if inFlight[m.Key] {
			overlaps.Add(1)
		}
		inFlight[m.Key] = true
		mu.Unlock()
		got.add(delivery{key: m.Key, value: string(m.Value), partition: m.Partition, offset: m.Offset})
		mu.Lock()
		inFlight[m.Key] = false
		mu.Unlock()
		return nil
	})
	eventually(t, "every record", func() bool { return got.len() >= keys*perKey })
	stop()

	if n := overlaps.Load(); n != 0 {
		t.Errorf("records of one key were handled at the same time %d times", n)
	}
	next := map[string]int{}
	for _, d := range got.snapshot() {
		if want := strconv.Itoa(next[d.key]); d.value != want {
			t.Fatalf("key %s: handled %s, want %s next", d.key, d.value, want)
		}
		next[d.key]++
	}
	for k := range keys {
		if n := next["key-"+strconv.Itoa(k)]; n != perKey {
			t.Errorf("key-%d handled %d times, want %d", k, n, perKey)
		}
	}
	for part, c := range partitionCounts(got.snapshot()) {
		if off := e.committed(group, topic, part); off != int64(c) {
			t.Errorf("partition %d: committed offset %d, want %d", part, off, c)
		}
	}
}

func TestConcurrentLanesOverlap(t *testing.T) {
	const topic, group, lanes, records = "bus.test.lanes-overlap", "lanes-overlap", 8, 64
	e := newEnv(t)
	e.topics(topic)
	e.publish(e.producer(), batch(topic, "req", records)...)

	var mu sync.Mutex
	inFlight, most := 0, 0
	allBusy := make(chan struct{})
	var handled atomic.Int32
	cfg := e.consumerConfig(group, topic)
	cfg.Concurrency = lanes
	e.run(cfg, func(ctx context.Context, _ bus.Received) error {
		mu.Lock()
		inFlight++
		if inFlight > most {
			most = inFlight
			if most == lanes {
				close(allBusy)
			}
		}
		mu.Unlock()
		defer func() {
			mu.Lock()
			inFlight--
			mu.Unlock()
			handled.Add(1)
		}()
		// Block until every lane holds a record (or give up at the
		// deadline, which fails the test below).
		select {
		case <-allBusy:
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(waitLimit):
		}
		return nil
	})
	eventually(t, "every record", func() bool { return handled.Load() == records })
	mu.Lock()
	defer mu.Unlock()
	if most != lanes {
		t.Fatalf("at most %d records were handled at once, want %d (one per lane)", most, lanes)
	}
}

func TestConcurrentCommitsOnlyTheSettledPrefix(t *testing.T) {
	for _, sync := range []bool{false, true} {
		t.Run("sync="+strconv.FormatBool(sync), func(t *testing.T) {
			const topic, group, n, slow = "bus.test.lanes-watermark", "lanes-watermark", 10, 5
			e := newEnv(t)
			e.topicsWith(1, topic)
			e.publish(e.producer(), batch(topic, "req", n)...)

			var got seen[int64]
			cfg := e.consumerConfig(group, topic)
			cfg.Concurrency = 4
			cfg.SyncCommit = sync
			stop := e.run(cfg, func(ctx context.Context, m bus.Received) error {
				if m.Offset == slow {
					<-ctx.Done() // the slow record: done only when the consumer stops
					return ctx.Err()
				}
				got.add(m.Offset)
				return nil
			})
			eventually(t, "the records before the slow one committed", func() bool { return e.committed(group, topic, 0) == slow })
			eventually(t, "a record after the slow one handled", func() bool {
				return slices.ContainsFunc(got.snapshot(), func(o int64) bool { return o > slow })
			})
			stop()
			if off := e.committed(group, topic, 0); off != slow {
				t.Fatalf("committed offset after stop = %d, want %d: the slow record is not settled", off, slow)
			}

			var again seen[delivery]
			e.run(e.consumerConfig(group, topic), recordTo(&again, "next"))
			eventually(t, "the redelivery", func() bool { return again.len() >= n-slow })
			for i, d := range again.snapshot() {
				if d.offset != int64(slow+i) {
					t.Fatalf("redelivery %d at offset %d, want %d", i, d.offset, slow+i)
				}
			}
		})
	}
}

func TestConcurrentPoisonIsDeadLetteredWithoutBlocking(t *testing.T) {
	tests := []struct {
		name       string
		fail       func() error
		wantReason string
	}{
		{"permanent", func() error { return bus.Permanent(kvcore.ReasonUndecodable, errors.New("bad json")) }, "undecodable"},
		{"retries exhausted", func() error { return bus.Transient(errors.New("busy")) }, "retries_exhausted"},
		{"panic", func() error { panic("boom") }, "handler_panic"},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			topic, group := fmt.Sprintf("bus.test.lanes-poison%d", i), fmt.Sprintf("lanes-poison%d", i)
			const n, poison = 40, 13
			e := newEnv(t)
			e.topics(topic)
			msgs := batch(topic, "req", n)
			msgs[poison].Value = []byte("poison")
			e.publish(e.producer(), msgs...)

			var got seen[delivery]
			var deadLetters seen[string]
			cfg := e.consumerConfig(group, topic)
			cfg.Concurrency = 4
			cfg.OnDeadLetter = deadLetterLog(&deadLetters)
			stop := e.run(cfg, func(_ context.Context, m bus.Received) error {
				if string(m.Value) == "poison" {
					return tt.fail()
				}
				got.add(delivery{key: m.Key, partition: m.Partition, offset: m.Offset})
				return nil
			})
			eventually(t, "the other records", func() bool { return got.len() >= n-1 })
			eventually(t, "the dead letter", func() bool { return deadLetters.len() >= 1 })
			counts := map[int]int{}
			for _, m := range e.readAll(topic, n) {
				counts[m.Partition]++
			}
			eventually(t, "every partition committed to its end", func() bool {
				for part, c := range counts {
					if e.committed(group, topic, part) != int64(c) {
						return false
					}
				}
				return true
			})
			stop()
			if got := deadLetters.snapshot(); len(got) != 1 || got[0] != "poison:"+tt.wantReason {
				t.Errorf("dead letters %v, want only the poison record with %s", got, tt.wantReason)
			}
			keys := map[string]bool{}
			for _, d := range got.snapshot() {
				if keys[d.key] {
					t.Errorf("record %s handled twice", d.key)
				}
				keys[d.key] = true
			}
			if len(keys) != n-1 || keys["req-"+strconv.Itoa(poison)] {
				t.Errorf("handled %d records %s, want the %d others", len(keys), strings.Join(slices.Sorted(maps.Keys(keys)), ","), n-1)
			}
		})
	}
}
