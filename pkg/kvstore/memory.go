package kvstore

import (
	"container/list"
	"context"
	"fmt"
	"sync"
)

// MemoryOptions configures a Memory store. The zero value is an unbounded
// store with no value size limit.
type MemoryOptions struct {
	// CapacityBytes bounds the sum of len(key)+len(value) over all entries;
	// zero or negative means unbounded.
	CapacityBytes int64
	// NoEviction makes a Put that would exceed CapacityBytes fail with
	// ErrNoSpace instead of evicting least recently used entries.
	NoEviction bool
	// MaxValueBytes rejects larger values with ErrTooLarge; zero or negative
	// means no limit.
	MaxValueBytes int
}

// Memory is an in-process Store with a byte capacity and optional LRU
// eviction. Get refreshes an entry's recency; Exists does not (like Redis
// EXISTS). It is safe for concurrent use and copies values in and out.
type Memory struct {
	opts MemoryOptions

	mu      sync.Mutex
	entries map[string]*list.Element // values are *memEntry
	recency *list.List               // front is most recently used
	used    int64
	closed  bool
}

type memEntry struct {
	key   string
	value []byte
}

func (e *memEntry) cost() int64 { return int64(len(e.key) + len(e.value)) }

var _ Store = (*Memory)(nil)

// NewMemory returns an empty Memory store.
func NewMemory(opts MemoryOptions) *Memory {
	return &Memory{
		opts:    opts,
		entries: make(map[string]*list.Element),
		recency: list.New(),
	}
}

// Exists implements Store.
func (m *Memory) Exists(ctx context.Context, keys []string) ([]bool, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if err := m.usable(ctx, "exists"); err != nil {
		return nil, err
	}
	found := make([]bool, len(keys))
	for i, k := range keys {
		_, found[i] = m.entries[k]
	}
	return found, nil
}

// Put implements Store. Values are copied before the lock is taken.
func (m *Memory) Put(ctx context.Context, items []Item) ([]error, error) {
	owned := make([]Item, len(items))
	for i, it := range items {
		owned[i] = Item{Key: it.Key, Value: append([]byte{}, it.Value...)}
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if err := m.usable(ctx, "put"); err != nil {
		return nil, err
	}
	errs := make([]error, len(owned))
	for i, it := range owned {
		errs[i] = m.putLocked(it)
	}
	return errs, nil
}

// Get implements Store. Values are copied after the lock is released,
// which is safe because stored values are never modified in place.
func (m *Memory) Get(ctx context.Context, keys []string) ([][]byte, []error, error) {
	shared, errs, err := m.getShared(ctx, keys)
	if err != nil {
		return nil, nil, err
	}
	values := make([][]byte, len(keys))
	for i, v := range shared {
		if errs[i] == nil {
			values[i] = append([]byte{}, v...)
		}
	}
	return values, errs, nil
}

// getShared looks keys up, refreshing their recency, and returns the stored
// values themselves.
func (m *Memory) getShared(ctx context.Context, keys []string) ([][]byte, []error, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if err := m.usable(ctx, "get"); err != nil {
		return nil, nil, err
	}
	values := make([][]byte, len(keys))
	errs := make([]error, len(keys))
	for i, k := range keys {
		el, ok := m.entries[k]
		if !ok {
			errs[i] = ErrNotFound
			continue
		}
		m.recency.MoveToFront(el)
		values[i] = el.Value.(*memEntry).value
	}
	return values, errs, nil
}

// Remove implements Store.
func (m *Memory) Remove(ctx context.Context, keys []string) ([]error, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if err := m.usable(ctx, "remove"); err != nil {
		return nil, err
	}
	errs := make([]error, len(keys))
	for i, k := range keys {
		el, ok := m.entries[k]
		if !ok {
			errs[i] = ErrNotFound
			continue
		}
		m.removeLocked(el)
	}
	return errs, nil
}

// Ping implements Store.
func (m *Memory) Ping(ctx context.Context) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.usable(ctx, "ping")
}

// Close implements Store: it drops all entries.
func (m *Memory) Close() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.closed = true
	m.entries = nil
	m.recency = nil
	m.used = 0
	return nil
}

// Usage returns the number of entries and the bytes they account for
// against CapacityBytes.
func (m *Memory) Usage() (keys int, bytes int64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.entries), m.used
}

// usable reports why op cannot run now: a done ctx or a closed store.
// The caller holds m.mu.
func (m *Memory) usable(ctx context.Context, op string) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("kvstore: memory %s: %w", op, err)
	}
	if m.closed {
		return fmt.Errorf("kvstore: memory %s: %w", op, ErrClosed)
	}
	return nil
}

// putLocked stores one item, whose value the store owns, evicting least
// recently used entries when the capacity requires it and eviction is enabled.
func (m *Memory) putLocked(it Item) error {
	if limit := m.opts.MaxValueBytes; limit > 0 && len(it.Value) > limit {
		return fmt.Errorf("%w: %d bytes, limit %d", ErrTooLarge, len(it.Value), limit)
	}
	if _, exists := m.entries[it.Key]; exists {
		return fmt.Errorf("%w: %s", ErrExists, it.Key)
	}
	e := &memEntry{key: it.Key, value: it.Value}
	if err := m.checkSpace(e.cost()); err != nil {
		return err
	}
	for m.opts.CapacityBytes > 0 && m.used+e.cost() > m.opts.CapacityBytes {
		m.removeLocked(m.recency.Back())
	}
	m.entries[it.Key] = m.recency.PushFront(e)
	m.used += e.cost()
	return nil
}

// checkSpace reports ErrNoSpace when a new entry of the given cost cannot
// be stored.
func (m *Memory) checkSpace(cost int64) error {
	capacity := m.opts.CapacityBytes
	if capacity <= 0 {
		return nil
	}
	if cost > capacity {
		return fmt.Errorf("%w: entry of %d bytes exceeds capacity %d", ErrNoSpace, cost, capacity)
	}
	if m.opts.NoEviction && m.used+cost > capacity {
		return fmt.Errorf("%w: %d of %d bytes used", ErrNoSpace, m.used, capacity)
	}
	return nil
}

func (m *Memory) removeLocked(el *list.Element) {
	e := m.recency.Remove(el).(*memEntry)
	delete(m.entries, e.key)
	m.used -= e.cost()
}
