package kvstore_test

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/kvmesh/kvmesh/internal/kvstoretest"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
)

func TestMemoryContract(t *testing.T) {
	opts := map[string]kvstore.MemoryOptions{
		"Unbounded":         {},
		"BoundedLRU":        {CapacityBytes: 64 << 20},
		"BoundedNoEviction": {CapacityBytes: 64 << 20, NoEviction: true},
	}
	for name, o := range opts {
		t.Run(name, func(t *testing.T) {
			kvstoretest.RunContractTests(t, func(t *testing.T) kvstore.Store {
				return newMemory(t, o)
			})
		})
	}
}

func newMemory(t *testing.T, o kvstore.MemoryOptions) *kvstore.Memory {
	m := kvstore.NewMemory(o)
	t.Cleanup(func() {
		if err := m.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return m
}

// entryCost is the capacity a one-letter key with a 10-byte value uses.
const entryCost = 1 + 10

func item(key string) kvstore.Item {
	return kvstore.Item{Key: key, Value: []byte(fmt.Sprintf("%-10s", key))}
}

func TestMemoryLRUEvictsLeastRecentlyUsed(t *testing.T) {
	tests := []struct {
		name  string
		touch func(m *kvstore.Memory) error // between putting a, b, c and putting d
		want  []bool                        // Exists(a, b, c, d)
	}{
		{"no access evicts the oldest", func(*kvstore.Memory) error { return nil }, []bool{false, true, true, true}},
		{"get refreshes recency", func(m *kvstore.Memory) error {
			_, _, err := m.Get(context.Background(), []string{"a"})
			return err
		}, []bool{true, false, true, true}},
		{"exists does not refresh recency", func(m *kvstore.Memory) error {
			_, err := m.Exists(context.Background(), []string{"a"})
			return err
		}, []bool{false, true, true, true}},
		{"a put of a present key writes and refreshes nothing", func(m *kvstore.Memory) error {
			errs, err := m.Put(context.Background(), []kvstore.Item{item("a")})
			if err == nil && !errors.Is(errs[0], kvstore.ErrExists) {
				return fmt.Errorf("put of present a: %v, want ErrExists", errs[0])
			}
			return err
		}, []bool{false, true, true, true}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			m := newMemory(t, kvstore.MemoryOptions{CapacityBytes: 3 * entryCost})
			if err := putAll(m, item("a"), item("b"), item("c")); err != nil {
				t.Fatal(err)
			}
			if err := tc.touch(m); err != nil {
				t.Fatal(err)
			}
			if err := putAll(m, item("d")); err != nil {
				t.Fatal(err)
			}
			found, err := m.Exists(context.Background(), []string{"a", "b", "c", "d"})
			if err != nil {
				t.Fatal(err)
			}
			if fmt.Sprint(found) != fmt.Sprint(tc.want) {
				t.Errorf("Exists(a, b, c, d) = %v, want %v", found, tc.want)
			}
			if keys, used := m.Usage(); keys != 3 || used != 3*entryCost {
				t.Errorf("Usage() = %d keys, %d bytes; want 3, %d", keys, used, 3*entryCost)
			}
		})
	}
}

func TestMemoryNoEvictionAnswersNoSpace(t *testing.T) {
	ctx := context.Background()
	m := newMemory(t, kvstore.MemoryOptions{CapacityBytes: 3 * entryCost, NoEviction: true})
	if err := putAll(m, item("a"), item("b")); err != nil {
		t.Fatal(err)
	}
	errs, err := m.Put(ctx, []kvstore.Item{item("c"), item("d"), item("b")})
	if err != nil {
		t.Fatal(err)
	}
	if errs[0] != nil || !errors.Is(errs[1], kvstore.ErrNoSpace) || !errors.Is(errs[2], kvstore.ErrExists) {
		t.Fatalf("Put(c, d, b) on a store with room for one more = %v; want [nil ErrNoSpace ErrExists]", errs)
	}
	if kvstore.IsTransient(errs[1]) {
		t.Errorf("IsTransient(%v) = true, want false", errs[1])
	}
	found, err := m.Exists(ctx, []string{"a", "b", "c", "d"})
	if err != nil || fmt.Sprint(found) != "[true true true false]" {
		t.Errorf("Exists(a, b, c, d) = %v, %v; want [true true true false]", found, err)
	}
	if _, err := m.Remove(ctx, []string{"a"}); err != nil {
		t.Fatal(err)
	}
	if err := putAll(m, item("d")); err != nil {
		t.Errorf("Put after freeing space: %v", err)
	}
}

func TestMemoryEntryLargerThanCapacity(t *testing.T) {
	for _, noEviction := range []bool{false, true} {
		t.Run(fmt.Sprintf("NoEviction=%v", noEviction), func(t *testing.T) {
			m := newMemory(t, kvstore.MemoryOptions{CapacityBytes: 3 * entryCost, NoEviction: noEviction})
			if err := putAll(m, item("a")); err != nil {
				t.Fatal(err)
			}
			big := kvstore.Item{Key: "z", Value: make([]byte, 3*entryCost)}
			errs, err := m.Put(context.Background(), []kvstore.Item{big})
			if err != nil || !errors.Is(errs[0], kvstore.ErrNoSpace) {
				t.Errorf("Put of an entry over capacity = %v, %v; want [ErrNoSpace]", errs, err)
			}
			if keys, used := m.Usage(); keys != 1 || used != entryCost {
				t.Errorf("Usage() = %d keys, %d bytes; want the one entry kept (1, %d)", keys, used, entryCost)
			}
		})
	}
}

func TestMemoryMaxValueBytes(t *testing.T) {
	m := newMemory(t, kvstore.MemoryOptions{MaxValueBytes: 4})
	errs, err := m.Put(context.Background(), []kvstore.Item{
		{Key: "ok", Value: []byte("1234")},
		{Key: "big", Value: []byte("12345")},
	})
	if err != nil {
		t.Fatal(err)
	}
	if errs[0] != nil || !errors.Is(errs[1], kvstore.ErrTooLarge) {
		t.Errorf("Put errors = %v, want [nil ErrTooLarge]", errs)
	}
	found, err := m.Exists(context.Background(), []string{"ok", "big"})
	if err != nil || fmt.Sprint(found) != "[true false]" {
		t.Errorf("Exists(ok, big) = %v, %v; want [true false]", found, err)
	}
}

func TestMemoryUsageAccounting(t *testing.T) {
	ctx := context.Background()
	m := newMemory(t, kvstore.MemoryOptions{})
	steps := []struct {
		name      string
		do        func() error
		wantKeys  int
		wantBytes int64
	}{
		{"put two", func() error { return putAll(m, item("a"), item("b")) }, 2, 2 * entryCost},
		{"put of a present key", func() error {
			if err := putAll(m, kvstore.Item{Key: "a", Value: []byte("x")}); !errors.Is(err, kvstore.ErrExists) {
				return fmt.Errorf("put of present a: %v, want ErrExists", err)
			}
			return nil
		}, 2, 2 * entryCost},
		{"remove one", func() error { _, err := m.Remove(ctx, []string{"b"}); return err }, 1, entryCost},
		{"remove absent", func() error { _, err := m.Remove(ctx, []string{"b"}); return err }, 1, entryCost},
	}
	for _, s := range steps {
		if err := s.do(); err != nil {
			t.Fatalf("%s: %v", s.name, err)
		}
		if keys, used := m.Usage(); keys != s.wantKeys || used != s.wantBytes {
			t.Errorf("after %s: Usage() = %d, %d; want %d, %d", s.name, keys, used, s.wantKeys, s.wantBytes)
		}
	}
}

// putAll puts items and returns the whole-batch error or the first per-key one.
func putAll(s kvstore.Store, items ...kvstore.Item) error {
	errs, err := s.Put(context.Background(), items)
	if err != nil {
		return err
	}
	for i, e := range errs {
		if e != nil {
			return fmt.Errorf("put %s: %w", items[i].Key, e)
		}
	}
	return nil
}

func TestIsTransient(t *testing.T) {
	tests := []struct {
		err  error
		want bool
	}{
		{nil, false},
		{fmt.Errorf("redis exists: %w: connection refused", kvstore.ErrUnavailable), true},
		{fmt.Errorf("get: %w", context.DeadlineExceeded), true},
		{fmt.Errorf("get: %w", context.Canceled), false},
		{kvstore.ErrNoSpace, false},
		{kvstore.ErrNotFound, false},
		{kvstore.ErrTooLarge, false},
		{kvstore.ErrClosed, false},
	}
	for _, tc := range tests {
		if got := kvstore.IsTransient(tc.err); got != tc.want {
			t.Errorf("IsTransient(%v) = %v, want %v", tc.err, got, tc.want)
		}
	}
}
