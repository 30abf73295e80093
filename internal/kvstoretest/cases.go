package kvstoretest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/pkg/kvstore"
)

func testEmptyBatches(t *testing.T, h *harness) {
	ctx := context.Background()
	found, err := h.s.Exists(ctx, nil)
	if err != nil || len(found) != 0 {
		t.Errorf("Exists(nil) = %v, %v; want empty, nil", found, err)
	}
	errs, err := h.s.Put(ctx, nil)
	if err != nil || len(errs) != 0 {
		t.Errorf("Put(nil) = %v, %v; want empty, nil", errs, err)
	}
	values, errs, err := h.s.Get(ctx, nil)
	if err != nil || len(values) != 0 || len(errs) != 0 {
		t.Errorf("Get(nil) = %v, %v, %v; want empty, empty, nil", values, errs, err)
	}
	errs, err = h.s.Remove(ctx, nil)
	if err != nil || len(errs) != 0 {
		t.Errorf("Remove(nil) = %v, %v; want empty, nil", errs, err)
	}
}

func testExistsMixed(t *testing.T, h *harness) {
	present := map[int]bool{1: true, 4: true, 5: true, 7: true}
	for i := range present {
		h.put(kvstore.Item{Key: h.key(i), Value: valueFor(i, 8)})
	}
	order := []int{7, 0, 1, 2, 4, 3, 5, 6, 1, 0}
	keys := make([]string, len(order))
	for j, i := range order {
		keys[j] = h.key(i)
	}
	found := h.exists(keys...)
	for j, i := range order {
		if found[j] != present[i] {
			t.Errorf("Exists index %d (key %d) = %v, want %v", j, i, found[j], present[i])
		}
	}
}

func testRoundTrip(t *testing.T, h *harness) {
	allBytes := make([]byte, 256)
	for i := range allBytes {
		allBytes[i] = byte(i)
	}
	big := make([]byte, 1<<20)
	rng := rand.NewChaCha8([32]byte{1, 2, 3})
	_, _ = rng.Read(big) // ChaCha8.Read never fails
	cases := []struct {
		name  string
		value []byte
		want  []byte
	}{
		{"empty", []byte{}, []byte{}},
		{"nil stored as empty", nil, []byte{}},
		{"text", []byte("hello, kv cache"), []byte("hello, kv cache")},
		{"all byte values", allBytes, allBytes},
		{"protocol-like bytes", []byte("\r\n$5\r\nOOM\r\n*0\r\n\x00"), []byte("\r\n$5\r\nOOM\r\n*0\r\n\x00")},
		{"1 MiB random", big, big},
	}
	items := make([]kvstore.Item, len(cases))
	keys := make([]string, len(cases))
	for i, c := range cases {
		keys[i] = h.key(i)
		items[i] = kvstore.Item{Key: keys[i], Value: c.value}
	}
	h.put(items...)
	values, errs := h.get(keys...)
	for i, c := range cases {
		h.wantValue(c.name, values[i], errs[i], c.want)
	}
}

func testGetMissing(t *testing.T, h *harness) {
	h.put(kvstore.Item{Key: h.key(0), Value: []byte("zero")},
		kvstore.Item{Key: h.key(2), Value: []byte("two")})
	values, errs := h.get(h.key(0), h.key(1), h.key(2), h.key(3))
	h.wantValue("index 0", values[0], errs[0], []byte("zero"))
	h.wantMissing("index 1", values[1], errs[1])
	h.wantValue("index 2", values[2], errs[2], []byte("two"))
	h.wantMissing("index 3", values[3], errs[3])
}

func testDuplicateKeys(t *testing.T, h *harness) {
	k := h.key(0)
	h.written[k] = true
	errs, err := h.s.Put(context.Background(), []kvstore.Item{{Key: k, Value: []byte("first")}, {Key: k, Value: []byte("second")}})
	if err != nil {
		t.Fatalf("Put(k, k): %v", err)
	}
	if errs[0] != nil || !errors.Is(errs[1], kvstore.ErrExists) {
		t.Fatalf("Put(k, k) errors = %v, want [nil ErrExists]", errs)
	}
	values, errs := h.get(k, h.key(1), k)
	h.wantValue("first occurrence", values[0], errs[0], []byte("first"))
	h.wantMissing("absent key", values[1], errs[1])
	h.wantValue("second occurrence", values[2], errs[2], []byte("first"))
	if found := h.exists(k, k); !found[0] || !found[1] {
		t.Errorf("Exists(k, k) = %v, want [true true]", found)
	}
	errs, err = h.s.Remove(context.Background(), []string{k, k})
	if err != nil {
		t.Fatalf("Remove(k, k): %v", err)
	}
	if errs[0] != nil || !errors.Is(errs[1], kvstore.ErrNotFound) {
		t.Errorf("Remove(k, k) errors = %v, want [nil ErrNotFound]", errs)
	}
}

// testWriteOnce: a Put of a present key writes nothing and reports
// ErrExists; the key keeps its first value.
func testWriteOnce(t *testing.T, h *harness) {
	k := h.key(0)
	first := valueFor(1, 4096)
	h.put(kvstore.Item{Key: k, Value: first})
	errs, err := h.s.Put(context.Background(), []kvstore.Item{{Key: k, Value: []byte("short")}, {Key: h.key(1), Value: []byte("new")}})
	h.written[h.key(1)] = true
	if err != nil || errs[0] == nil || !errors.Is(errs[0], kvstore.ErrExists) || errs[1] != nil {
		t.Fatalf("Put of a present key and a new one = %v, %v; want [ErrExists nil]", errs, err)
	}
	values, gerrs := h.get(k, h.key(1))
	h.wantValue("after the second put", values[0], gerrs[0], first)
	h.wantValue("the new key", values[1], gerrs[1], []byte("new"))
}

func testRemove(t *testing.T, h *harness) {
	a, b := h.key(0), h.key(2)
	h.put(kvstore.Item{Key: a, Value: []byte("a")}, kvstore.Item{Key: b, Value: []byte("b")})
	errs, err := h.s.Remove(context.Background(), []string{a, h.key(1), b})
	if err != nil {
		t.Fatalf("Remove: %v", err)
	}
	mustLen(t, "Remove errors", len(errs), 3)
	if errs[0] != nil || !errors.Is(errs[1], kvstore.ErrNotFound) || errs[2] != nil {
		t.Errorf("Remove errors = %v, want [nil ErrNotFound nil]", errs)
	}
	if found := h.exists(a, b); found[0] || found[1] {
		t.Errorf("Exists after Remove = %v, want [false false]", found)
	}
	values, gerrs := h.get(a)
	h.wantMissing("Get after Remove", values[0], gerrs[0])
}

func testLargeBatch(t *testing.T, h *harness) {
	const n = 2000
	items := make([]kvstore.Item, n)
	for i := range items {
		items[i] = kvstore.Item{Key: h.key(2 * i), Value: valueFor(i, 100)}
	}
	h.put(items...)
	found := h.exists(h.keys(2 * n)...)
	for i, f := range found {
		if want := i%2 == 0; f != want {
			t.Fatalf("Exists index %d = %v, want %v", i, f, want)
		}
	}
	reversed := make([]string, n)
	for i := range reversed {
		reversed[i] = items[n-1-i].Key
	}
	values, errs := h.get(reversed...)
	for i := range reversed {
		h.wantValue(fmt.Sprintf("reversed index %d", i), values[i], errs[i], items[n-1-i].Value)
	}
}

func testNoAliasing(t *testing.T, h *harness) {
	k := h.key(0)
	buf := []byte("original")
	h.put(kvstore.Item{Key: k, Value: buf})
	copy(buf, "CHANGED!")
	values, errs := h.get(k)
	h.wantValue("after caller changed its Put buffer", values[0], errs[0], []byte("original"))
	if values[0] != nil {
		copy(values[0], "MUTATED!")
	}
	values, errs = h.get(k)
	h.wantValue("after caller changed a Get result", values[0], errs[0], []byte("original"))
}

func testCancelledContext(t *testing.T, h *harness) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	for name, err := range callAll(t, ctx, h) {
		if !errors.Is(err, context.Canceled) {
			t.Errorf("%s on a cancelled context: error %v, want context.Canceled", name, err)
		}
		if kvstore.IsTransient(err) {
			t.Errorf("%s: IsTransient(%v) = true, want false for cancellation", name, err)
		}
	}
}

func testExpiredDeadline(t *testing.T, h *harness) {
	ctx, cancel := context.WithDeadline(context.Background(), time.Now().Add(-time.Second))
	defer cancel()
	for name, err := range callAll(t, ctx, h) {
		if !errors.Is(err, context.DeadlineExceeded) || !kvstore.IsTransient(err) {
			t.Errorf("%s past its deadline: error %v, want transient context.DeadlineExceeded", name, err)
		}
	}
}

// callAll calls every Store method with ctx and returns their whole-batch
// errors by method name, failing the test if any call hangs.
func callAll(t *testing.T, ctx context.Context, h *harness) map[string]error {
	t.Helper()
	keys := []string{h.key(0), h.key(1)}
	done := make(chan map[string]error, 1)
	go func() {
		errs := map[string]error{}
		_, errs["Exists"] = h.s.Exists(ctx, keys)
		_, errs["Put"] = h.s.Put(ctx, []kvstore.Item{{Key: keys[0], Value: []byte("x")}})
		_, _, errs["Get"] = h.s.Get(ctx, keys)
		_, errs["Remove"] = h.s.Remove(ctx, keys)
		errs["Ping"] = h.s.Ping(ctx)
		done <- errs
	}()
	h.written[keys[0]] = true // in case the Put wrongly succeeded
	select {
	case errs := <-done:
		return errs
	case <-time.After(hangLimit):
		t.Fatalf("calls on a done context did not return within %v", hangLimit)
		return nil
	}
}

// testConcurrent: workers put keys of their own and race on one shared
// key, reading their own back: exactly one Put of the shared key stores
// it (the others get ErrExists) and it keeps that worker's whole value.
func testConcurrent(t *testing.T, h *harness) {
	const workers, rounds, perBatch = 8, 20, 5
	shared := h.key(1 << 40)
	h.written[shared] = true
	for i := range workers * rounds * perBatch {
		h.written[h.key(i)] = true
	}
	var (
		wg      sync.WaitGroup
		mu      sync.Mutex
		winners []int
	)
	for w := range workers {
		wg.Go(func() {
			for r := range rounds {
				won, err := concurrentRound(h, w, r, rounds, perBatch, shared)
				if err != nil {
					t.Errorf("worker %d round %d: %v", w, r, err)
					return
				}
				if won {
					mu.Lock()
					winners = append(winners, w)
					mu.Unlock()
				}
			}
		})
	}
	wg.Wait()
	if len(winners) != 1 {
		t.Fatalf("the shared key was stored by %d puts (workers %v), want exactly 1", len(winners), winners)
	}
	values, errs := h.get(shared)
	h.wantValue("shared key", values[0], errs[0], valueFor(winners[0], 256))
}

// concurrentRound writes worker w's keys of round r and the shared key,
// then reads its own keys back; won says whether its put stored the
// shared key.
func concurrentRound(h *harness, w, r, rounds, perBatch int, shared string) (won bool, _ error) {
	ctx := context.Background()
	items := []kvstore.Item{{Key: shared, Value: valueFor(w, 256)}}
	keys := make([]string, perBatch)
	for i := range keys {
		keys[i] = h.key((w*rounds+r)*perBatch + i)
		items = append(items, kvstore.Item{Key: keys[i], Value: valueFor(w*1000+r, 64+i)})
	}
	errs, err := h.s.Put(ctx, items)
	if err != nil {
		return false, fmt.Errorf("put: %w", err)
	}
	if errs[0] != nil && !errors.Is(errs[0], kvstore.ErrExists) {
		return false, fmt.Errorf("put of the shared key: %w", errs[0])
	}
	if i := slices.IndexFunc(errs[1:], func(e error) bool { return e != nil }); i >= 0 {
		return false, fmt.Errorf("put item %d: %w", i+1, errs[i+1])
	}
	values, gerrs, err := h.s.Get(ctx, keys)
	if err != nil {
		return false, fmt.Errorf("get: %w", err)
	}
	for i := range keys {
		if gerrs[i] != nil || !bytes.Equal(values[i], items[i+1].Value) {
			return false, fmt.Errorf("key %d: got %s (%v), want %s", i, describe(values[i]), gerrs[i], describe(items[i+1].Value))
		}
	}
	return errs[0] == nil, nil
}

func testPingAndClose(t *testing.T, h *harness) {
	ctx := context.Background()
	if err := h.s.Ping(ctx); err != nil {
		t.Fatalf("Ping: %v", err)
	}
	if err := h.s.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if err := h.s.Close(); err != nil {
		t.Errorf("second Close: %v, want nil", err)
	}
	if err := h.s.Ping(ctx); !errors.Is(err, kvstore.ErrClosed) {
		t.Errorf("Ping after Close: %v, want ErrClosed", err)
	}
	if _, err := h.s.Exists(ctx, []string{h.key(0)}); !errors.Is(err, kvstore.ErrClosed) {
		t.Errorf("Exists after Close: %v, want ErrClosed", err)
	}
	if _, err := h.s.Put(ctx, []kvstore.Item{{Key: h.key(0)}}); !errors.Is(err, kvstore.ErrClosed) {
		t.Errorf("Put after Close: %v, want ErrClosed", err)
	}
}

// testHashTagKeys stores keys with braces, which a Redis Cluster reads as
// hash tags ({tag} picks the slot; "{}" and an unclosed "{" do not), mixed
// in one batch with plain keys: each must read back its own value, in order.
func testHashTagKeys(t *testing.T, h *harness) {
	suffixes := []string{"{tag}a", "{tag}b", "{}x", "{unclosed", "}{tag}", "{a}{b}", "plain"}
	items := make([]kvstore.Item, len(suffixes))
	keys := make([]string, len(suffixes))
	for i, sfx := range suffixes {
		keys[i] = h.key(i) + sfx
		items[i] = kvstore.Item{Key: keys[i], Value: valueFor(i, 64)}
	}
	h.put(items...)
	slices.Reverse(keys)
	values, errs := h.get(keys...)
	for j := range keys {
		i := len(keys) - 1 - j
		h.wantValue(fmt.Sprintf("Get %q", keys[j]), values[j], errs[j], items[i].Value)
	}
	for j, ok := range h.exists(keys...) {
		if !ok {
			t.Errorf("Exists %q = false after Put", keys[j])
		}
	}
}
