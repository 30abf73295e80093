package kvstore

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/redis/go-redis/v9"
)

// Defaults for RedisOptions fields left at zero.
const (
	// DefaultRedisMaxValueBytes is the default RedisOptions.MaxValueBytes.
	DefaultRedisMaxValueBytes = 64 << 20
	// DefaultRedisMaxBatchKeys is the default RedisOptions.MaxBatchKeys.
	DefaultRedisMaxBatchKeys = 4096
	// DefaultRedisMaxBatchBytes is the default RedisOptions.MaxBatchBytes.
	DefaultRedisMaxBatchBytes = 64 << 20
)

// initialGetEstimate is the value size Get assumes before it has seen one,
// to size its first pipeline (the top of the usual 16 KiB–2 MiB range).
const initialGetEstimate = 2 << 20

// RedisOptions configures a Redis store. Zero fields take the defaults noted;
// the pool and timeout fields override the URL's query parameters when set.
type RedisOptions struct {
	// PoolSize is the connection pool size (default: go-redis's, 10 per CPU).
	PoolSize int
	// DialTimeout bounds connecting (default 5 s).
	DialTimeout time.Duration
	// ReadTimeout bounds reading one pipeline's replies (default 5 s). A
	// context deadline bounds socket I/O too, but go-redis does not watch
	// for cancellation: a call whose context is cancelled while it waits on
	// the socket returns within ReadTimeout.
	ReadTimeout time.Duration
	// WriteTimeout bounds writing one pipeline (default: ReadTimeout).
	WriteTimeout time.Duration
	// MaxRetries is how often go-redis retries a pipeline after a
	// connection error (default 3; -1 disables retries).
	MaxRetries int
	// DialAttempts is how often one connection dial is tried, 100 ms apart,
	// before a call fails (default 5). Lower it to detect a down server sooner.
	DialAttempts int
	// TTL, when positive, expires stored values after that long.
	TTL time.Duration
	// MaxValueBytes rejects larger values with ErrTooLarge, without sending
	// them (default DefaultRedisMaxValueBytes).
	MaxValueBytes int
	// MaxBatchKeys bounds the keys in one pipeline (default
	// DefaultRedisMaxBatchKeys); larger batches are sent in several.
	MaxBatchKeys int
	// MaxBatchBytes bounds the key and value bytes in one Put pipeline and
	// the expected reply bytes of one Get pipeline, estimated from the
	// largest value seen so far in the call (default DefaultRedisMaxBatchBytes).
	MaxBatchBytes int
	// TLS names the CA bundle, client certificate and server name of a
	// rediss:// or rediss+cluster:// URL (zero: go-redis's defaults, the
	// system roots); with a plain URL any setting is an error.
	TLS RedisTLS
}

func (o RedisOptions) withDefaults() RedisOptions {
	if o.MaxValueBytes <= 0 {
		o.MaxValueBytes = DefaultRedisMaxValueBytes
	}
	if o.MaxBatchKeys <= 0 {
		o.MaxBatchKeys = DefaultRedisMaxBatchKeys
	}
	if o.MaxBatchBytes <= 0 {
		o.MaxBatchBytes = DefaultRedisMaxBatchBytes
	}
	o.TTL = max(o.TTL, 0)
	return o
}

// apply copies the connection settings that are set onto ro.
func (o RedisOptions) apply(ro *redis.Options) {
	o.setConn(&ro.PoolSize, &ro.DialTimeout, &ro.ReadTimeout, &ro.WriteTimeout, &ro.MaxRetries, &ro.DialerRetries)
	// Let the caller's deadline bound socket I/O, not only pool waits.
	ro.ContextTimeoutEnabled = true
	if ro.PipelineWriteBufferSize == 0 { // the URL's pipeline_write_buffer_size wins
		ro.PipelineWriteBufferSize = pipelineWriteBuffer
	}
}

// pipelineWriteBuffer is the write buffer of the single-server client's
// pipeline connections (go-redis's default: 128 KiB). A large value
// argument is copied into the buffer only as far as the buffer has room,
// then flushed, and the rest goes to the socket straight from the value:
// with 128 KiB, half of every 256 KiB block was copied once more on its
// way to the socket (a put's dominant cost after the kernel's own copy and
// the framing copy). A small buffer copies a few KiB of each value, still
// gathers the commands' headers and small arguments into one write, and a
// pipeline of large values makes the same two writes a value either way.
const pipelineWriteBuffer = 16 << 10

// applyCluster copies the connection settings that are set onto co, for
// every node's client.
func (o RedisOptions) applyCluster(co *redis.ClusterOptions) {
	o.setConn(&co.PoolSize, &co.DialTimeout, &co.ReadTimeout, &co.WriteTimeout, &co.MaxRetries, &co.DialerRetries)
	co.ContextTimeoutEnabled = true
}

// setConn stores the connection settings that are set through the
// pointers to one go-redis options struct's fields.
func (o RedisOptions) setConn(pool *int, dial, read, write *time.Duration, retries, dialAttempts *int) {
	if o.PoolSize > 0 {
		*pool = o.PoolSize
	}
	if o.DialTimeout > 0 {
		*dial = o.DialTimeout
	}
	if o.ReadTimeout > 0 {
		*read = o.ReadTimeout
	}
	if o.WriteTimeout > 0 {
		*write = o.WriteTimeout
	}
	if o.MaxRetries != 0 {
		*retries = o.MaxRetries
	}
	if o.DialAttempts > 0 {
		*dialAttempts = o.DialAttempts
	}
}

// RedisClientOptions are the go-redis client options of the store pool at
// url with opts' connection settings, for a client of the same server
// beside the Store (the sender's watcher of keyspace notifications): the
// same URL parsing, pool, timeouts and context deadlines as NewRedis. A
// cluster URL (IsClusterURL) is an error: use RedisClusterOptions. The
// TLS configuration of a rediss:// URL is built from opts.TLS.
func RedisClientOptions(url string, opts RedisOptions) (*redis.Options, error) {
	if IsClusterURL(url) {
		return nil, fmt.Errorf("kvstore: redis url: %w", errClusterURL)
	}
	ro, err := redis.ParseURL(url)
	if err != nil {
		return nil, fmt.Errorf("kvstore: redis url: %w", urlError(err))
	}
	if ro.TLSConfig, err = opts.TLS.config(ro.TLSConfig); err != nil {
		return nil, fmt.Errorf("kvstore: redis tls: %w", err)
	}
	opts.apply(ro)
	return ro, nil
}

// Redis is a Store backed by Redis or Valkey, a single server or a Redis
// Cluster. Each batch is sent as pipelines bounded by
// RedisOptions.MaxBatchKeys and MaxBatchBytes; against a cluster,
// go-redis's ClusterClient splits each pipeline by node, follows MOVED and
// ASK redirections and retries TRYAGAIN and CLUSTERDOWN (up to
// MaxRedirects), and per-key results stay in input order.
type Redis struct {
	client redis.UniversalClient // a *redis.Client or a *redis.ClusterClient
	// fast answers Exists on a single server (nil: go-redis answers it).
	fast   *existsPipe
	opts   RedisOptions
	closed atomic.Bool
}

var (
	_ Store        = (*Redis)(nil)
	_ ValueVisitor = (*Redis)(nil)
)

// NewRedis connects to the Redis server or cluster at url and checks it
// with PING. A single server is redis://[user:pass@]host:port/db, or
// rediss:// for TLS; a cluster is named by its seed nodes,
// redis+cluster://[user:pass@]host:port,host:port,... or rediss+cluster://
// (see RedisClusterOptions). A failed check wraps ErrUnavailable.
func NewRedis(ctx context.Context, url string, opts RedisOptions) (*Redis, error) {
	r := &Redis{opts: opts.withDefaults()}
	var where string
	var tlsCfg *tls.Config
	if IsClusterURL(url) {
		co, err := RedisClusterOptions(url, opts)
		if err != nil {
			return nil, err
		}
		r.client, where, tlsCfg = redis.NewClusterClient(co), "cluster "+strings.Join(co.Addrs, ","), co.TLSConfig
	} else {
		ro, err := RedisClientOptions(url, opts)
		if err != nil {
			return nil, err
		}
		r.client, where, tlsCfg = redis.NewClient(ro), ro.Addr, ro.TLSConfig
		r.fast = newExistsPipe(ro)
	}
	if err := r.client.Ping(ctx).Err(); err != nil {
		_ = r.client.Close() // the ping error is the one worth reporting
		err = r.commandErr(ctx, "connect "+where, err)
		if tlsCfg == nil && (errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET)) {
			// What a TLS port does to a plain client: it drops the connection.
			err = fmt.Errorf("%w (%w)", err, errPlainToTLS)
		}
		return nil, err
	}
	return r, nil
}

// Exists implements Store. On a single server it goes over the store's
// own connections (existsPipe): one round trip of multi-key EXISTS over
// runs of keys, and a second only for runs partly present, with no
// allocation a key. Against a cluster it is one pipeline of EXISTS per
// MaxBatchKeys keys, which go-redis splits by node and sends at once
// (multi-key EXISTS needs all its keys in one slot). Exists keeps no
// reference to keys once it returns. (A Lua script answering a whole batch
// in one string reply was measured slower: Redis runs a script's
// redis.call of EXISTS about five times slower than a pipelined EXISTS.)
func (r *Redis) Exists(ctx context.Context, keys []string) ([]bool, error) {
	if err := r.usable(ctx, "exists"); err != nil {
		return nil, err
	}
	found := make([]bool, len(keys))
	if r.fast != nil {
		if err := r.fast.exists(ctx, keys, found, r.opts.MaxBatchKeys); err != nil {
			return nil, r.commandErr(ctx, "exists", err)
		}
		return found, nil
	}
	err := r.perKeyInts(ctx, "exists", keys,
		func(p redis.Pipeliner, k string) *redis.IntCmd { return p.Exists(ctx, k) },
		func(i int, cmd *redis.IntCmd) error {
			n, err := cmd.Result()
			if err != nil {
				return fmt.Errorf("kvstore: redis exists: %w", replyErr(err))
			}
			found[i] = n > 0
			return nil
		})
	if err != nil {
		return nil, err
	}
	return found, nil
}

// perKeyInts sends one integer-reply command per key, queued by queue, in
// pipelines of at most MaxBatchKeys, and hands each reply to record with
// the key's index. It stops at the first error from a pipeline or record.
func (r *Redis) perKeyInts(ctx context.Context, op string, keys []string,
	queue func(redis.Pipeliner, string) *redis.IntCmd, record func(int, *redis.IntCmd) error,
) error {
	for lo := 0; lo < len(keys); lo += r.opts.MaxBatchKeys {
		chunk := keys[lo:min(len(keys), lo+r.opts.MaxBatchKeys)]
		cmds := make([]*redis.IntCmd, len(chunk))
		err := r.pipelined(ctx, op, func(p redis.Pipeliner) {
			for i, k := range chunk {
				cmds[i] = queue(p, k)
			}
		})
		if err != nil {
			return err
		}
		for i, cmd := range cmds {
			if err := record(lo+i, cmd); err != nil {
				return err
			}
		}
	}
	return nil
}

// Put implements Store with pipelines of SET … NX, chunked by keys and bytes.
// Values over MaxValueBytes get ErrTooLarge and are not sent.
func (r *Redis) Put(ctx context.Context, items []Item) ([]error, error) {
	if err := r.usable(ctx, "put"); err != nil {
		return nil, err
	}
	errs := make([]error, len(items))
	var chunk []int
	size := 0
	for i, it := range items {
		if len(it.Value) > r.opts.MaxValueBytes {
			errs[i] = fmt.Errorf("%w: %d bytes, limit %d", ErrTooLarge, len(it.Value), r.opts.MaxValueBytes)
			continue
		}
		n := len(it.Key) + len(it.Value)
		if len(chunk) > 0 && (len(chunk) == r.opts.MaxBatchKeys || size+n > r.opts.MaxBatchBytes) {
			if err := r.putChunk(ctx, items, chunk, errs); err != nil {
				return nil, err
			}
			chunk, size = chunk[:0], 0
		}
		chunk = append(chunk, i)
		size += n
	}
	if err := r.putChunk(ctx, items, chunk, errs); err != nil {
		return nil, err
	}
	return errs, nil
}

// putChunk sends the items at the indices in chunk as one pipeline and
// records their per-key results in errs.
func (r *Redis) putChunk(ctx context.Context, items []Item, chunk []int, errs []error) error {
	if len(chunk) == 0 {
		return nil
	}
	cmds := make([]*redis.BoolCmd, len(chunk))
	err := r.pipelined(ctx, "put", func(p redis.Pipeliner) {
		for j, i := range chunk {
			cmds[j] = p.SetNX(ctx, items[i].Key, items[i].Value, r.opts.TTL)
		}
	})
	if err != nil {
		return err
	}
	for j, i := range chunk {
		set, err := cmds[j].Result()
		switch {
		case err != nil:
			errs[i] = replyErr(err)
		case !set:
			errs[i] = fmt.Errorf("%w: %s", ErrExists, items[i].Key)
		}
	}
	return nil
}

// Get implements Store with pipelines of GET. Each pipeline holds at most
// MaxBatchKeys keys and, by the largest value seen so far in this call, at
// most MaxBatchBytes of replies.
func (r *Redis) Get(ctx context.Context, keys []string) ([][]byte, []error, error) {
	if err := r.usable(ctx, "get"); err != nil {
		return nil, nil, err
	}
	values := make([][]byte, len(keys))
	errs := make([]error, len(keys))
	largest := initialGetEstimate
	for lo := 0; lo < len(keys); {
		hi := min(len(keys), lo+r.getChunkKeys(largest))
		seen, err := r.getChunk(ctx, keys[lo:hi], values[lo:hi], errs[lo:hi])
		if err != nil {
			return nil, nil, err
		}
		if seen > 0 {
			largest = seen
		}
		lo = hi
	}
	return values, errs, nil
}

// GetEach implements ValueVisitor. On a single server it reads each value
// over the store's own connections into one reused buffer per connection,
// in pipelines bounded as Get's are; against a cluster it calls Get.
func (r *Redis) GetEach(ctx context.Context, keys []string, use func(i int, value []byte) error) ([]error, error) {
	if err := r.usable(ctx, "get"); err != nil {
		return nil, err
	}
	if r.fast == nil {
		return getEachOf(ctx, r.Get, keys, use)
	}
	errs := make([]error, len(keys))
	largest := initialGetEstimate
	for lo := 0; lo < len(keys); {
		hi := min(len(keys), lo+r.getChunkKeys(largest))
		seen, err := r.getEachChunk(ctx, keys[lo:hi], errs[lo:hi], func(i int, v []byte) error { return use(lo+i, v) })
		if err != nil {
			return nil, r.batchErr(ctx, "get", err)
		}
		for i := lo; i < hi; i++ {
			var re respError
			if errs[i] != nil && errors.As(errs[i], &re) {
				errs[i] = replyErr(errs[i])
			}
		}
		if seen > 0 {
			largest = seen
		}
		lo = hi
	}
	return errs, nil
}

// getEachChunk runs one GET pipeline on the store's own connections. A
// pipeline on a reused connection that failed before its first reply is
// tried once more on a new one (the server may have closed an idle
// connection); GET is read-only, so retrying is safe.
func (r *Redis) getEachChunk(ctx context.Context, keys []string, errs []error, use func(int, []byte) error) (int, error) {
	cn, reused, err := r.fast.get(ctx)
	if err != nil {
		return 0, err
	}
	seen, answered, err := r.fast.getEach(ctx, cn, keys, errs, use)
	if err != nil && reused && answered == 0 && ctx.Err() == nil {
		if cn, _, err = r.fast.dialed(ctx); err == nil {
			seen, _, err = r.fast.getEach(ctx, cn, keys, errs, use)
		}
	}
	return seen, err
}

// getEachOf calls get and hands each present value to use.
func getEachOf(ctx context.Context, get func(context.Context, []string) ([][]byte, []error, error),
	keys []string, use func(int, []byte) error,
) ([]error, error) {
	values, errs, err := get(ctx, keys)
	if err != nil {
		return nil, err
	}
	for i, v := range values {
		if errs[i] == nil {
			errs[i] = use(i, v)
		}
	}
	return errs, nil
}

// getChunkKeys is how many keys the next Get pipeline may hold when values
// are expected to be up to largest bytes.
func (r *Redis) getChunkKeys(largest int) int {
	return max(1, min(r.opts.MaxBatchKeys, r.opts.MaxBatchBytes/max(largest, 1)))
}

// getChunk fetches keys in one pipeline into values and errs and returns
// the largest value size it saw.
func (r *Redis) getChunk(ctx context.Context, keys []string, values [][]byte, errs []error) (int, error) {
	cmds := make([]*redis.StringCmd, len(keys))
	err := r.pipelined(ctx, "get", func(p redis.Pipeliner) {
		for i, k := range keys {
			cmds[i] = p.Get(ctx, k)
		}
	})
	if err != nil {
		return 0, err
	}
	largest := 0
	for i, cmd := range cmds {
		// Bytes shares the reply's freshly allocated buffer, which nothing
		// else references: the caller owns it.
		v, err := cmd.Bytes()
		if err != nil {
			errs[i] = replyErr(err)
			continue
		}
		if v == nil {
			v = []byte{}
		}
		values[i] = v
		largest = max(largest, len(v))
	}
	return largest, nil
}

// Remove implements Store with pipelines of DEL per MaxBatchKeys keys.
func (r *Redis) Remove(ctx context.Context, keys []string) ([]error, error) {
	if err := r.usable(ctx, "remove"); err != nil {
		return nil, err
	}
	errs := make([]error, len(keys))
	err := r.perKeyInts(ctx, "remove", keys,
		func(p redis.Pipeliner, k string) *redis.IntCmd { return p.Del(ctx, k) },
		func(i int, cmd *redis.IntCmd) error {
			errs[i] = delResult(cmd)
			return nil
		})
	if err != nil {
		return nil, err
	}
	return errs, nil
}

func delResult(cmd *redis.IntCmd) error {
	n, err := cmd.Result()
	switch {
	case err != nil:
		return replyErr(err)
	case n == 0:
		return ErrNotFound
	default:
		return nil
	}
}

// Ping implements Store.
func (r *Redis) Ping(ctx context.Context) error {
	if err := r.usable(ctx, "ping"); err != nil {
		return err
	}
	if err := r.client.Ping(ctx).Err(); err != nil {
		return r.commandErr(ctx, "ping", err)
	}
	return nil
}

// commandErr classifies the error of a single command outside a batch.
func (r *Redis) commandErr(ctx context.Context, op string, err error) error {
	if isReply(err) {
		return fmt.Errorf("kvstore: redis %s: %w", op, replyErr(err))
	}
	return r.batchErr(ctx, op, err)
}

// Close implements Store: it closes the connection pool.
func (r *Redis) Close() error {
	if r.closed.Swap(true) {
		return nil
	}
	if r.fast != nil {
		r.fast.close()
	}
	if err := r.client.Close(); err != nil {
		return fmt.Errorf("kvstore: redis close: %w", err)
	}
	return nil
}

// usable reports why op cannot start: a done ctx or a closed store.
func (r *Redis) usable(ctx context.Context, op string) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("kvstore: redis %s: %w", op, err)
	}
	if r.closed.Load() {
		return fmt.Errorf("kvstore: redis %s: %w", op, ErrClosed)
	}
	return nil
}

// pipelined runs the commands fill queues as one pipeline. It returns a
// whole-batch error when ctx is done or any command failed without a server
// reply; per-command reply errors are left on the commands.
func (r *Redis) pipelined(ctx context.Context, op string, fill func(redis.Pipeliner)) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("kvstore: redis %s: %w", op, err)
	}
	cmds, err := r.client.Pipelined(ctx, func(p redis.Pipeliner) error {
		fill(p)
		return nil
	})
	if err != nil && !isReply(err) {
		return r.batchErr(ctx, op, err)
	}
	transient := false
	for _, cmd := range cmds {
		err := cmd.Err()
		if err != nil && !isReply(err) {
			return r.batchErr(ctx, op, err)
		}
		transient = transient || (err != nil && isTransientReply(err))
	}
	if transient {
		// CLUSTERDOWN, TRYAGAIN and the like: the slot map may be changing.
		r.reloadTopology()
	}
	return nil
}

// batchErr classifies an error that is not a server reply: the caller's
// ctx, a closed client, or a connection-level failure.
func (r *Redis) batchErr(ctx context.Context, op string, err error) error {
	cerr := ctx.Err()
	if dl, ok := ctx.Deadline(); ok && cerr == nil && !time.Now().Before(dl) {
		// The socket deadline, set from ctx's, can fire before ctx's timer.
		cerr = context.DeadlineExceeded
	}
	switch {
	case cerr != nil:
		return fmt.Errorf("kvstore: redis %s: %w", op, cerr)
	case errors.Is(err, redis.ErrClosed):
		return fmt.Errorf("kvstore: redis %s: %w", op, ErrClosed)
	default:
		r.reloadTopology()
		return fmt.Errorf("kvstore: redis %s: %w: %w", op, ErrUnavailable, err)
	}
}

// reloadTopology asks a cluster client to reload the slot map in the
// background after a node failed to answer. go-redis reloads it by itself
// on MOVED replies and once a minute, but not when a master is gone: until
// then it would send that master's slots to a dead address, even after a
// replica took them over.
func (r *Redis) reloadTopology() {
	if cc, ok := r.client.(*redis.ClusterClient); ok {
		cc.ReloadState(context.Background()) // returns at once; the reload runs in the background
	}
}

// isReply reports whether err is a reply from the server (including the
// nil reply), as opposed to a client-side or connection failure.
func isReply(err error) bool {
	var re redis.Error
	return errors.As(err, &re)
}

// replyErr maps one command's reply error to the package's errors.
func replyErr(err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, redis.Nil):
		return ErrNotFound
	case redis.IsOOMError(err):
		return fmt.Errorf("%w: %w", ErrNoSpace, err)
	case isTransientReply(err):
		return fmt.Errorf("%w: %w", ErrUnavailable, err)
	default:
		return fmt.Errorf("kvstore: redis: %w", err)
	}
}

// isTransientReply reports server replies that mean "not now": a loading,
// read-only, failing-over or busy server, or a cluster whose slots are
// moving or not all served.
func isTransientReply(err error) bool {
	if _, moved := redis.IsMovedError(err); moved {
		return true // redirections left over after MaxRedirects: slots are moving
	}
	if _, ask := redis.IsAskError(err); ask {
		return true
	}
	return redis.IsLoadingError(err) || redis.IsReadOnlyError(err) ||
		redis.IsMasterDownError(err) || redis.IsTryAgainError(err) ||
		redis.IsClusterDownError(err) || redis.IsMaxClientsError(err) ||
		redis.HasErrorPrefix(err, "BUSY ")
}
