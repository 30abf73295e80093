package testenv

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// Settings of the key helpers.
const (
	// keyBatch is how many keys EachKeyBatch scans and hands over at once.
	keyBatch = 1000
	// keysWithin bounds one EachKeyBatch call.
	keysWithin = 30 * time.Second
)

// KeyPrefix returns a fresh store key prefix (KVMESH_KEY_PREFIX): tag
// followed by 8 random hex digits, so that tests sharing one Redis keep
// their keys apart.
func KeyPrefix(tag string) string {
	var b [4]byte
	_, _ = rand.Read(b[:]) // crypto/rand.Read never fails
	return tag + hex.EncodeToString(b[:])
}

// EachKeyBatch calls f with every key of the Redis at redisURL under prefix
// (the keys matching prefix@*), in batches of at most 1000, all within 30 s.
// The keys are listed before the first call, so f may change them.
func EachKeyBatch(redisURL, prefix string, f func(ctx context.Context, c *redis.Client, keys []string) error) error {
	ro, err := redis.ParseURL(redisURL)
	if err != nil {
		return fmt.Errorf("redis URL: %w", err)
	}
	c := redis.NewClient(ro)
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), keysWithin)
	defer cancel()
	var keys []string
	it := c.Scan(ctx, 0, prefix+"@*", keyBatch).Iterator()
	for it.Next(ctx) {
		keys = append(keys, it.Val())
	}
	if err := it.Err(); err != nil {
		return fmt.Errorf("scan %s@*: %w", prefix, err)
	}
	for len(keys) > 0 {
		n := min(len(keys), keyBatch)
		if err := f(ctx, c, keys[:n]); err != nil {
			return err
		}
		keys = keys[n:]
	}
	return nil
}

// DropKeys deletes every key under prefix (see EachKeyBatch) from the Redis
// at redisURL; the test fails, and goes on, when that does not work. Tests
// call it at cleanup to leave the shared Redis as they found it.
func DropKeys(t testing.TB, redisURL, prefix string) {
	t.Helper()
	err := EachKeyBatch(redisURL, prefix, func(ctx context.Context, c *redis.Client, keys []string) error {
		return c.Del(ctx, keys...).Err()
	})
	if err != nil {
		t.Errorf("delete the test's keys: %v", err)
	}
}
