package sim

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
)

// storeCheckBatch is the number of keys one store Get asks for.
const storeCheckBatch = 256

// StoreCheck is the check of every value the run's saves stored: each key
// a BlockStored event of a run request named is read from the store, and
// its value must decode (dataplane.DecodeValue, the model's fingerprint) to
// exactly the content its key implies (BlockContent of its group, rank
// namespace and hash). A key belongs to exactly one namespace, which must
// be one of its group's (kvcore.Model.Namespaces), and holds the bytes of
// the worker ranks whose StoreRank that namespace is.
type StoreCheck struct {
	// Keys counts the distinct keys the run's BlockStored events named.
	Keys int `json:"keys"`
	// Announced counts the keys in those events (a key stored twice counts
	// twice); LedgerStored is what the save results report stored. Fewer
	// announced than stored means events were missed (not a failure).
	Announced    int `json:"announced"`
	LedgerStored int `json:"ledger_stored"`
	// Checked counts the values read and compared.
	Checked int `json:"checked"`
	// Wrong counts values that did not decode or held other bytes.
	Wrong int `json:"wrong"`
	// Gone counts keys no longer in the store (evicted by the store's LRU,
	// or removed): not wrong.
	Gone int `json:"gone"`
	// GoneAnnounced counts the gone keys a BlockRemoved event named by the
	// time of the check (the sender's removal watcher saw Redis drop them).
	// Fewer than Gone means removals still in flight or lost (Redis pub/sub
	// is at-most-once): not a failure.
	GoneAnnounced int `json:"gone_announced"`
	// Wrongs lists the first wrong values.
	Wrongs []WrongValue `json:"wrongs"`
	// gone lists the gone keys, for the wait for their BlockRemoved events.
	gone []string
	// Error says why the check could not run (to its end).
	Error string `json:"error,omitempty"`
	// OK is set when the check ran and no value was wrong.
	OK bool `json:"ok"`
}

// WrongValue is one stored value that is not what its key implies.
type WrongValue struct {
	// Key is the store key.
	Key string `json:"key"`
	// Problem says what is wrong.
	Problem string `json:"problem"`
}

// checkStored reads every key from the store at cfg.RedisURL, in batches,
// and checks its value.
func checkStored(ctx context.Context, cfg Config, keys []string, removed func(string) bool) StoreCheck {
	c := StoreCheck{Keys: len(keys), Wrongs: []WrongValue{}}
	st, err := kvstore.NewRedis(ctx, cfg.RedisURL, kvstore.RedisOptions{TLS: cfg.RedisTLS})
	if err != nil {
		c.Error = fmt.Sprintf("store: %v", err)
		return c
	}
	defer st.Close()
	if err := checkValues(ctx, st, cfg.Model, cfg.RequestTimeout, keys, &c, storeCheckBatch, removed); err != nil {
		c.Error = err.Error()
		return c
	}
	c.OK = c.Wrong == 0
	return c
}

// checkValues checks the keys' values in st, batch keys per Get, counting
// into c (a gone key also into GoneAnnounced when removed says a
// BlockRemoved named it); a failing Get is retried for up to bound.
func checkValues(ctx context.Context, st kvstore.Store, m *kvcore.Model, bound time.Duration, keys []string, c *StoreCheck, batchKeys int, removed func(string) bool) error {
	cont := newContents(m)
	for start := 0; start < len(keys); start += batchKeys {
		batch := keys[start:min(start+batchKeys, len(keys))]
		var values [][]byte
		var errs []error
		err := retryFor(ctx, bound, func() error {
			var err error
			values, errs, err = st.Get(ctx, batch)
			return err
		})
		if err != nil {
			return fmt.Errorf("store get of %d keys: %w", len(batch), err)
		}
		problems := make([]string, len(batch))
		parallel(len(batch), func(i int) {
			if errs[i] == nil {
				problems[i] = cont.checkValue(batch[i], values[i])
			}
		})
		for i, k := range batch {
			switch {
			case errors.Is(errs[i], kvstore.ErrNotFound):
				c.Gone++
				c.gone = append(c.gone, k)
				if removed(k) {
					c.GoneAnnounced++
				}
				continue
			case errs[i] != nil:
				return fmt.Errorf("store get %s: %w", k, errs[i])
			}
			c.Checked++
			if problems[i] != "" {
				c.Wrong++
				if len(c.Wrongs) < maxListed {
					c.Wrongs = append(c.Wrongs, WrongValue{Key: k, Problem: problems[i]})
				}
			}
		}
	}
	return nil
}

// checkValue says what is wrong with a stored value of key, or "" when it
// is exactly the content the key implies.
func (c contents) checkValue(key string, value []byte) string {
	p, err := kvcore.ParseKey(key)
	switch {
	case err != nil:
		return err.Error()
	case p.Model != c.m.Name:
		return fmt.Sprintf("key of model %s, the run's is %s", p.Model, c.m.Name)
	case p.Group < 0 || p.Group >= len(c.m.Groups):
		return fmt.Sprintf("group %d of a %d-group model", p.Group, len(c.m.Groups))
	case !slices.Contains(c.m.Namespaces(p.Group), p.Rank):
		return fmt.Sprintf("rank namespace %s is not one of group %d's at %s", p.Rank, p.Group, LayoutText(c.m))
	}
	payload, err := dataplane.DecodeValue(c.fp, value)
	if err != nil {
		return fmt.Sprintf("value does not decode: %v", err)
	}
	if !c.matches(payload, p.Group, p.Rank, p.Hash) {
		return fmt.Sprintf("value holds other bytes than its key's content (%d bytes)", len(payload))
	}
	return ""
}
