package kvstore

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// QuotaIndexSuffix ends the name of a namespace's quota marks: the sorted
// set "{namespace}@quota" holds the hash of every key of the namespace
// removed to keep its tenant within a quota (RemoveForQuota), scored by
// the key's store time, until whoever observes the removal takes the mark
// (TakeQuotaMarks), so telling it from an operator's delete and knowing
// the block's age. Like StoredIndexSuffix it is not a hex hash, so the
// set is never taken for a block key.
const QuotaIndexSuffix = "@quota"

// StoredKey is one key of a store-time index and when it was stored.
type StoredKey struct {
	// Key is the store key (namespace and hash).
	Key string
	// StoredAt is its store time.
	StoredAt time.Time
}

// ErrIdleUntracked reports a server that keeps no idle time per key: its
// maxmemory-policy is an LFU one, so OBJECT IDLETIME is refused.
var ErrIdleUntracked = errors.New("kvstore: the store keeps no idle times (LFU maxmemory-policy)")

// Quotas is what a tenant quota needs of the store: its usage, read from
// the store-time indexes of its namespaces (StoreTimes), the candidates
// to remove and a removal that says why. Every namespace is a key's part
// before its hash (kvcore.SplitKey).
type Quotas interface {
	// CountStored returns how many keys each namespace's store-time index
	// holds.
	CountStored(ctx context.Context, namespaces []string) ([]int64, error)
	// OldestStored returns the n keys of the namespaces stored first,
	// oldest first (fewer when the indexes hold fewer).
	OldestStored(ctx context.Context, namespaces []string, n int) ([]StoredKey, error)
	// IdleTimes returns, per key, how long ago it was last read or written
	// (the server's LRU clock), or -1 for a key that is not present. A
	// server that keeps no idle times answers ErrIdleUntracked.
	IdleTimes(ctx context.Context, keys []string) ([]time.Duration, error)
	// RemoveForQuota removes each key at time at, marking it removed for
	// its tenant's quota (its namespace's quota marks, with its store
	// time) and taking it out of its store-time index; it returns how many
	// of the keys were present.
	RemoveForQuota(ctx context.Context, keys []StoredKey, at time.Time) (int, error)
	// TakeQuotaMarks returns, per key, the store time its quota mark
	// holds, or the zero time for a key not removed for a quota, and
	// takes the mark: a key is reported once.
	TakeQuotaMarks(ctx context.Context, keys []string) ([]time.Time, error)
}

var _ Quotas = (*Redis)(nil)

// CountStored implements Quotas with one pipeline of ZCARD.
func (r *Redis) CountStored(ctx context.Context, namespaces []string) ([]int64, error) {
	out := make([]int64, len(namespaces))
	if len(namespaces) == 0 {
		return out, nil
	}
	if err := r.usable(ctx, "count stored"); err != nil {
		return nil, err
	}
	cmds := make([]*redis.IntCmd, len(namespaces))
	if err := r.pipelined(ctx, "count stored", func(p redis.Pipeliner) {
		for i, ns := range namespaces {
			cmds[i] = p.ZCard(ctx, ns+StoredIndexSuffix)
		}
	}); err != nil {
		return nil, err
	}
	for i, c := range cmds {
		n, err := c.Result()
		if err != nil {
			return nil, fmt.Errorf("kvstore: redis count stored: %w", replyErr(err))
		}
		out[i] = n
	}
	return out, nil
}

// OldestStored implements Quotas with one pipeline of ZRANGE WITHSCORES
// (the first n of each index), merged by store time.
func (r *Redis) OldestStored(ctx context.Context, namespaces []string, n int) ([]StoredKey, error) {
	if len(namespaces) == 0 || n <= 0 {
		return nil, nil
	}
	if err := r.usable(ctx, "oldest stored"); err != nil {
		return nil, err
	}
	cmds := make([]*redis.ZSliceCmd, len(namespaces))
	if err := r.pipelined(ctx, "oldest stored", func(p redis.Pipeliner) {
		for i, ns := range namespaces {
			cmds[i] = p.ZRangeWithScores(ctx, ns+StoredIndexSuffix, 0, int64(n-1))
		}
	}); err != nil {
		return nil, err
	}
	var out []StoredKey
	for i, c := range cmds {
		zs, err := c.Result()
		if err != nil {
			return nil, fmt.Errorf("kvstore: redis oldest stored: %w", replyErr(err))
		}
		for _, z := range zs {
			member, _ := z.Member.(string) // go-redis answers members as strings
			out = append(out, StoredKey{Key: namespaces[i] + "@" + member, StoredAt: time.UnixMilli(int64(z.Score * 1e3))})
		}
	}
	slices.SortStableFunc(out, func(a, b StoredKey) int {
		return cmp.Or(a.StoredAt.Compare(b.StoredAt), strings.Compare(a.Key, b.Key))
	})
	return out[:min(n, len(out))], nil
}

// IdleTimes implements Quotas with one pipeline of OBJECT IDLETIME, which
// neither reads nor touches the values.
func (r *Redis) IdleTimes(ctx context.Context, keys []string) ([]time.Duration, error) {
	out := make([]time.Duration, len(keys))
	if len(keys) == 0 {
		return out, nil
	}
	if err := r.usable(ctx, "idle times"); err != nil {
		return nil, err
	}
	cmds := make([]*redis.DurationCmd, len(keys))
	if err := r.pipelined(ctx, "idle times", func(p redis.Pipeliner) {
		for i, k := range keys {
			cmds[i] = p.ObjectIdleTime(ctx, k)
		}
	}); err != nil {
		return nil, err
	}
	for i, c := range cmds {
		d, err := c.Result()
		switch {
		case errors.Is(err, redis.Nil):
			out[i] = -1
		case err != nil && strings.Contains(err.Error(), "LFU"):
			return nil, fmt.Errorf("%w: %w", ErrIdleUntracked, err)
		case err != nil:
			return nil, fmt.Errorf("kvstore: redis idle times: %w", replyErr(err))
		default:
			out[i] = d
		}
	}
	return out, nil
}

// RemoveForQuota implements Quotas with two pipelines: first, per key, a
// ZADD of its mark (scored by its store time) and a ZREM from its
// store-time index (the tenant's usage drops at once), and per quota set
// a ZREMRANGEBYSCORE of the marks past StoreTimesHorizon (a mark whose
// removal went unobserved does not stay); then an UNLINK per key. The
// marks so exist before any removal is notified, even on a cluster where
// a key and its marks sit on different masters. A mark that cannot be
// written (a full store that does not evict refuses it) does not hold the
// removal back: the key is removed and its removal is taken for an
// operator's delete.
func (r *Redis) RemoveForQuota(ctx context.Context, keys []StoredKey, at time.Time) (int, error) {
	if len(keys) == 0 {
		return 0, nil
	}
	if err := r.usable(ctx, "remove for quota"); err != nil {
		return 0, err
	}
	horizon := strconv.FormatFloat(float64(at.Add(-StoreTimesHorizon).UnixMilli())/1e3, 'f', 3, 64)
	trimmed := map[string]struct{}{}
	var valid []string
	var bad error
	err := r.pipelined(ctx, "mark quota removals", func(p redis.Pipeliner) {
		for _, k := range keys {
			marks, member, err := indexOf(k.Key, QuotaIndexSuffix)
			if err != nil {
				bad = err
				continue
			}
			valid = append(valid, k.Key)
			p.ZAdd(ctx, marks, redis.Z{Score: float64(k.StoredAt.UnixMilli()) / 1e3, Member: member})
			if _, done := trimmed[marks]; !done {
				trimmed[marks] = struct{}{}
				p.ZRemRangeByScore(ctx, marks, "-inf", "("+horizon)
			}
			p.ZRem(ctx, strings.TrimSuffix(marks, QuotaIndexSuffix)+StoredIndexSuffix, member)
		}
	})
	if err != nil {
		return 0, err
	}
	removed := 0
	err = r.perKeyInts(ctx, "remove for quota", valid,
		func(p redis.Pipeliner, k string) *redis.IntCmd { return p.Unlink(ctx, k) },
		func(_ int, cmd *redis.IntCmd) error {
			n, err := cmd.Result()
			if err != nil {
				return fmt.Errorf("kvstore: redis remove for quota: %w", replyErr(err))
			}
			removed += int(n)
			return nil
		})
	if err != nil {
		return removed, err
	}
	return removed, bad
}

// TakeQuotaMarks implements Quotas with one pipeline of ZSCORE and ZREM
// per key, in that order on its quota set's connection.
func (r *Redis) TakeQuotaMarks(ctx context.Context, keys []string) ([]time.Time, error) {
	return r.takeTimes(ctx, "take quota marks", QuotaIndexSuffix, keys)
}
