package sendpolicy

import (
	"cmp"
	"slices"
	"time"
)

// Usage is what a tenant holds in the store, or adds to it: keys and the
// bytes of their values.
type Usage struct {
	Bytes int64 `json:"bytes"`
	Keys  int64 `json:"keys"`
}

// Add returns u plus v.
func (u Usage) Add(v Usage) Usage { return Usage{Bytes: u.Bytes + v.Bytes, Keys: u.Keys + v.Keys} }

// Sub returns u minus v, never below zero.
func (u Usage) Sub(v Usage) Usage {
	return Usage{Bytes: max(0, u.Bytes-v.Bytes), Keys: max(0, u.Keys-v.Keys)}
}

// Zero reports whether u is nothing.
func (u Usage) Zero() bool { return u.Bytes <= 0 && u.Keys <= 0 }

// QuotaLimit is a tenant's quota: at most MaxBytes of values and MaxKeys
// keys in the store; zero leaves that side unlimited.
type QuotaLimit struct {
	MaxBytes int64 `json:"max_bytes,omitempty"`
	MaxKeys  int64 `json:"max_keys,omitempty"`
}

// Over is how much must leave a tenant holding u for add to fit within
// q: zero when it fits.
func (q QuotaLimit) Over(u, add Usage) Usage {
	var over Usage
	if q.MaxBytes > 0 {
		over.Bytes = max(0, u.Bytes+add.Bytes-q.MaxBytes)
	}
	if q.MaxKeys > 0 {
		over.Keys = max(0, u.Keys+add.Keys-q.MaxKeys)
	}
	return over
}

// Fit is how many of the values sized sizes, added in order to a tenant
// holding u, stay within q.
func (q QuotaLimit) Fit(u Usage, sizes []int64) int {
	for i, s := range sizes {
		u = u.Add(Usage{Bytes: s, Keys: 1})
		if !q.Over(u, Usage{}).Zero() {
			return i
		}
	}
	return len(sizes)
}

// QuotaCandidate is a stored key a quota may remove.
type QuotaCandidate struct {
	Key      string
	Bytes    int64
	StoredAt time.Time
	// Idle is how long ago the key was last read or written (0 when the
	// store keeps no idle times).
	Idle time.Duration
}

// Victims picks, among candidates, the keys to remove to free need: the
// least recently used first (the longest idle), then the first stored,
// until need is freed. It returns fewer, with what they free, when the
// candidates cannot free it all.
func Victims(candidates []QuotaCandidate, need Usage) ([]QuotaCandidate, Usage) {
	c := slices.Clone(candidates)
	slices.SortStableFunc(c, func(a, b QuotaCandidate) int {
		return cmp.Or(cmp.Compare(b.Idle, a.Idle), a.StoredAt.Compare(b.StoredAt), cmp.Compare(a.Key, b.Key))
	})
	var freed Usage
	for i, v := range c {
		if freed.Bytes >= need.Bytes && freed.Keys >= need.Keys {
			return c[:i], freed
		}
		freed = freed.Add(Usage{Bytes: v.Bytes, Keys: 1})
	}
	return c, freed
}
