package kvstore

import "github.com/redis/go-redis/v9"

// AddRedisHook lets the external tests observe the pipelines a Redis store sends.
func AddRedisHook(r *Redis, h redis.Hook) { r.client.AddHook(h) }
