// Package kvstoretest holds the contract test suite that every
// kvstore.Store implementation must pass.
package kvstoretest

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/pkg/kvstore"
)

// hangLimit is how long a call on a done context may take before the suite
// reports it as hung.
const hangLimit = 10 * time.Second

// RunContractTests runs the Store contract as subtests. newStore is called
// once per subtest and must return a working, empty-or-shared store whose
// Close it registers with t.Cleanup. Every key the suite writes starts with a
// random per-subtest prefix and is removed when the subtest ends, so stores
// backed by a shared server need no other isolation.
func RunContractTests(t *testing.T, newStore func(t *testing.T) kvstore.Store) {
	tests := []struct {
		name string
		run  func(t *testing.T, h *harness)
	}{
		{"EmptyBatches", testEmptyBatches},
		{"ExistsMixedBatchPreservesOrder", testExistsMixed},
		{"PutGetRoundTrip", testRoundTrip},
		{"GetMissingOnlyAtIndex", testGetMissing},
		{"DuplicateKeysInBatch", testDuplicateKeys},
		{"WriteOnce", testWriteOnce},
		{"Remove", testRemove},
		{"LargeBatchInOrder", testLargeBatch},
		{"HashTagLikeKeys", testHashTagKeys},
		{"NoAliasing", testNoAliasing},
		{"CancelledContext", testCancelledContext},
		{"ExpiredDeadline", testExpiredDeadline},
		{"ConcurrentPutGet", testConcurrent},
		{"PingAndClose", testPingAndClose},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			tc.run(t, newHarness(t, newStore(t)))
		})
	}
}

// harness wraps the store under test with helpers that fail the test on
// unexpected errors and remember the keys written for cleanup.
type harness struct {
	t       *testing.T
	s       kvstore.Store
	prefix  string
	written map[string]bool
}

func newHarness(t *testing.T, s kvstore.Store) *harness {
	var b [6]byte
	if _, err := rand.Read(b[:]); err != nil {
		t.Fatalf("random prefix: %v", err)
	}
	h := &harness{
		t:       t,
		s:       s,
		prefix:  "kvstoretest-" + hex.EncodeToString(b[:]) + "@test-model@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@",
		written: map[string]bool{},
	}
	t.Cleanup(h.cleanup)
	return h
}

func (h *harness) cleanup() {
	if len(h.written) == 0 {
		return
	}
	keys := make([]string, 0, len(h.written))
	for k := range h.written {
		keys = append(keys, k)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := h.s.Remove(ctx, keys); err != nil && !errors.Is(err, kvstore.ErrClosed) {
		h.t.Errorf("cleanup: remove %d keys: %v", len(keys), err)
	}
}

// key returns the i-th key of this subtest, in Mooncake's layout.
func (h *harness) key(i int) string {
	return fmt.Sprintf("%s%016x", h.prefix, i)
}

func (h *harness) keys(n int) []string {
	ks := make([]string, n)
	for i := range ks {
		ks[i] = h.key(i)
	}
	return ks
}

// put stores items and fails the test unless every item was stored.
func (h *harness) put(items ...kvstore.Item) {
	h.t.Helper()
	for _, it := range items {
		h.written[it.Key] = true
	}
	errs, err := h.s.Put(context.Background(), items)
	if err != nil {
		h.t.Fatalf("Put(%d items): %v", len(items), err)
	}
	mustLen(h.t, "Put errors", len(errs), len(items))
	for i, e := range errs {
		if e != nil {
			h.t.Fatalf("Put item %d (%s): %v", i, items[i].Key, e)
		}
	}
}

func (h *harness) exists(keys ...string) []bool {
	h.t.Helper()
	found, err := h.s.Exists(context.Background(), keys)
	if err != nil {
		h.t.Fatalf("Exists(%d keys): %v", len(keys), err)
	}
	mustLen(h.t, "Exists results", len(found), len(keys))
	return found
}

func (h *harness) get(keys ...string) ([][]byte, []error) {
	h.t.Helper()
	values, errs, err := h.s.Get(context.Background(), keys)
	if err != nil {
		h.t.Fatalf("Get(%d keys): %v", len(keys), err)
	}
	mustLen(h.t, "Get values", len(values), len(keys))
	mustLen(h.t, "Get errors", len(errs), len(keys))
	return values, errs
}

// wantValue fails unless a Get result is exactly want, present and non-nil.
func (h *harness) wantValue(what string, got []byte, err error, want []byte) {
	h.t.Helper()
	if err != nil {
		h.t.Errorf("%s: error %v, want value", what, err)
		return
	}
	if got == nil || !bytes.Equal(got, want) {
		h.t.Errorf("%s: got %s, want %s", what, describe(got), describe(want))
	}
}

// wantMissing fails unless a Get result is ErrNotFound with a nil value.
func (h *harness) wantMissing(what string, got []byte, err error) {
	h.t.Helper()
	if !errors.Is(err, kvstore.ErrNotFound) || got != nil {
		h.t.Errorf("%s: got %s, error %v; want nil value and ErrNotFound", what, describe(got), err)
	}
}

func mustLen(t *testing.T, what string, got, want int) {
	t.Helper()
	if got != want {
		t.Fatalf("%s: len %d, want %d", what, got, want)
	}
}

func describe(b []byte) string {
	if b == nil {
		return "nil"
	}
	if len(b) <= 16 {
		return fmt.Sprintf("%q", b)
	}
	return fmt.Sprintf("%d bytes starting %q", len(b), b[:16])
}

// valueFor returns a deterministic value of n bytes for index i.
func valueFor(i, n int) []byte {
	v := make([]byte, n)
	for j := range v {
		v[j] = byte(i*31 + j*7 + i>>8)
	}
	return v
}
