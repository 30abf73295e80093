package kvstore

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// StoredIndexSuffix ends the name of a namespace's store-time index: the
// sorted set "{namespace}@stored" holds, for every key of the namespace
// stored since the index began, the key's block hash scored by the Unix
// time (seconds) it was stored. The suffix is not a hex hash, so the
// index is never taken for a block key.
const StoredIndexSuffix = "@stored"

// StoreTimesHorizon is how long a store time is kept: MarkStored drops
// the times older than this from every index it writes to, so an index
// stays bounded even when removals go unobserved (keyspace notifications
// are at-most-once); the removal of a block stored earlier goes without
// its age.
const StoreTimesHorizon = 30 * 24 * time.Hour

// StoreTimes keeps the time each key was stored, so that whoever observes
// its removal can say how old the block was. Stores are written once
// (Put is SET NX), so a key's store time is its age's origin.
type StoreTimes interface {
	// MarkStored records at as the store time of each key not recorded
	// yet (a key stored again keeps its first time).
	MarkStored(ctx context.Context, keys []string, at time.Time) error
	// TakeStored removes each key from its index and returns the time it
	// was stored, or the zero time for a key with no record (stored
	// before the index began, or recorded twice removed). Taking a key
	// twice returns the zero time the second time.
	TakeStored(ctx context.Context, keys []string) ([]time.Time, error)
}

// errNotAKey reports a key MarkStored or TakeStored cannot index: it has
// no '@' before its hash.
var errNotAKey = errors.New("kvstore: not a store key (no namespace)")

var _ StoreTimes = (*Redis)(nil)

// indexOf splits key into the index of its namespace named by suffix
// (StoredIndexSuffix, QuotaIndexSuffix) and its member there (the hash).
func indexOf(key, suffix string) (index, member string, err error) {
	ns, hash, ok := kvcore.SplitKey(key)
	if !ok {
		return "", "", fmt.Errorf("%w: %q", errNotAKey, key)
	}
	return ns + suffix, hash, nil
}

// MarkStored implements StoreTimes with one pipeline of ZADD NX, one per
// key, the index of its namespace, and one ZREMRANGEBYSCORE per index of
// the times past StoreTimesHorizon (on a cluster go-redis sends each to
// its index's node).
func (r *Redis) MarkStored(ctx context.Context, keys []string, at time.Time) error {
	if len(keys) == 0 {
		return nil
	}
	if err := r.usable(ctx, "mark stored"); err != nil {
		return err
	}
	score := float64(at.UnixMilli()) / 1e3
	horizon := strconv.FormatFloat(float64(at.Add(-StoreTimesHorizon).UnixMilli())/1e3, 'f', 3, 64)
	trimmed := map[string]struct{}{}
	cmds := make([]*redis.IntCmd, 0, len(keys))
	var bad error
	err := r.pipelined(ctx, "mark stored", func(p redis.Pipeliner) {
		for _, k := range keys {
			index, member, err := indexOf(k, StoredIndexSuffix)
			if err != nil {
				bad = err
				continue
			}
			cmds = append(cmds, p.ZAddNX(ctx, index, redis.Z{Score: score, Member: member}))
			if _, done := trimmed[index]; !done {
				trimmed[index] = struct{}{}
				p.ZRemRangeByScore(ctx, index, "-inf", "("+horizon)
			}
		}
	})
	if err != nil {
		return err
	}
	for _, c := range cmds {
		if err := c.Err(); err != nil {
			return fmt.Errorf("kvstore: redis mark stored: %w", replyErr(err))
		}
	}
	return bad
}

// TakeStored implements StoreTimes with one pipeline of ZSCORE and ZREM
// per key, in that order on its index's connection.
func (r *Redis) TakeStored(ctx context.Context, keys []string) ([]time.Time, error) {
	return r.takeTimes(ctx, "take stored", StoredIndexSuffix, keys)
}

// takeTimes takes each key's member out of its namespace's sorted set
// named by suffix and returns the time its score held, or the zero time
// where it had none (or no namespace): one pipeline of ZSCORE and ZREM per
// key, in that order on the set's connection.
func (r *Redis) takeTimes(ctx context.Context, op, suffix string, keys []string) ([]time.Time, error) {
	out := make([]time.Time, len(keys))
	if len(keys) == 0 {
		return out, nil
	}
	if err := r.usable(ctx, op); err != nil {
		return nil, err
	}
	scores := make([]*redis.FloatCmd, len(keys))
	err := r.pipelined(ctx, op, func(p redis.Pipeliner) {
		for i, k := range keys {
			set, member, err := indexOf(k, suffix)
			if err != nil {
				continue // no namespace: no record, the zero time
			}
			scores[i] = p.ZScore(ctx, set, member)
			p.ZRem(ctx, set, member)
		}
	})
	if err != nil {
		return nil, err
	}
	for i, c := range scores {
		if c == nil {
			continue
		}
		s, err := c.Result()
		switch {
		case errors.Is(err, redis.Nil):
		case err != nil:
			return nil, fmt.Errorf("kvstore: redis %s: %w", op, replyErr(err))
		default:
			out[i] = time.UnixMilli(int64(s * 1e3))
		}
	}
	return out, nil
}
