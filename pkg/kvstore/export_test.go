package kvstore

import (
	"context"
	"errors"

	"github.com/redis/go-redis/v9"
)

// AddRedisHook lets the external tests observe the pipelines a Redis store sends.
func AddRedisHook(r *Redis, h redis.Hook) { r.client.AddHook(h) }

// AddRedisNodeHook adds newHook(addr) to the client of every node of a
// cluster store, present and future, so that the external tests can
// observe what each node is sent. It fails on a single-server store.
func AddRedisNodeHook(ctx context.Context, r *Redis, newHook func(addr string) redis.Hook) error {
	cc, ok := r.client.(*redis.ClusterClient)
	if !ok {
		return errors.New("not a cluster store")
	}
	cc.OnNewNode(func(c *redis.Client) { c.AddHook(newHook(c.Options().Addr)) })
	return cc.ForEachShard(ctx, func(_ context.Context, c *redis.Client) error {
		c.AddHook(newHook(c.Options().Addr))
		return nil
	})
}

// ExistsPipelines returns and resets how many pipelines a single-server
// store's Exists sent on its own connections, and whether it has them.
func ExistsPipelines(r *Redis) (int, bool) {
	if r.fast == nil {
		return 0, false
	}
	return r.fast.pipelines(), true
}
