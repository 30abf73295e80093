package kvstore_test

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/kvmesh/kvmesh/internal/kvstoretest"
	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
)

func TestRedisContract(t *testing.T) {
	url := testenv.RedisURL(t)
	opts := map[string]kvstore.RedisOptions{
		"Defaults": {},
		// Tiny pipelines: every batch crosses chunk boundaries and the
		// 1 MiB value exceeds MaxBatchBytes on its own.
		"SmallPipelines": {MaxBatchKeys: 7, MaxBatchBytes: 4096},
	}
	for name, o := range opts {
		t.Run(name, func(t *testing.T) {
			kvstoretest.RunContractTests(t, func(t *testing.T) kvstore.Store {
				return newRedis(t, url, o)
			})
		})
	}
}

func newRedis(t testing.TB, url string, o kvstore.RedisOptions) *kvstore.Redis {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	r, err := kvstore.NewRedis(ctx, url, o)
	if err != nil {
		t.Fatalf("NewRedis: %v", err)
	}
	t.Cleanup(func() {
		if err := r.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return r
}

// testKeys returns n keys under a random prefix and removes them from s
// when the test ends.
func testKeys(t testing.TB, s kvstore.Store, n int) []string {
	t.Helper()
	var b [6]byte
	if _, err := rand.Read(b[:]); err != nil {
		t.Fatalf("random prefix: %v", err)
	}
	keys := make([]string, n)
	for i := range keys {
		keys[i] = fmt.Sprintf("kvstore-test-%x@test-model@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@%016x", b, i)
	}
	t.Cleanup(func() {
		if _, err := s.Remove(context.Background(), keys); err != nil && !errors.Is(err, kvstore.ErrUnavailable) {
			t.Errorf("cleanup: %v", err)
		}
	})
	return keys
}

// pipelineStat describes one pipeline a store sent.
type pipelineStat struct {
	cmds       int
	argBytes   int // key and value bytes sent
	replyBytes int // bulk string bytes received
}

// dataCommands are the commands a store sends for its batches; others
// (connection set-up such as HELLO) are not recorded.
var dataCommands = map[string]bool{"exists": true, "set": true, "get": true, "del": true}

// pipelineLog is a go-redis hook recording every pipeline and single data
// command a store sends.
type pipelineLog struct {
	mu        sync.Mutex
	pipelines []pipelineStat
	singles   int
}

func (l *pipelineLog) DialHook(next redis.DialHook) redis.DialHook { return next }

func (l *pipelineLog) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if dataCommands[cmd.Name()] {
			l.mu.Lock()
			l.singles++
			l.mu.Unlock()
		}
		return next(ctx, cmd)
	}
}

func (l *pipelineLog) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		err := next(ctx, cmds)
		st := pipelineStat{cmds: len(cmds)}
		for _, cmd := range cmds {
			if !dataCommands[cmd.Name()] {
				return err
			}
			for _, a := range cmd.Args()[1:] {
				switch a := a.(type) {
				case string:
					st.argBytes += len(a)
				case []byte:
					st.argBytes += len(a)
				}
			}
			if sc, ok := cmd.(*redis.StringCmd); ok {
				st.replyBytes += len(sc.Val())
			}
		}
		l.mu.Lock()
		l.pipelines = append(l.pipelines, st)
		l.mu.Unlock()
		return err
	}
}

// take returns and forgets what was recorded so far.
func (l *pipelineLog) take() ([]pipelineStat, int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	p, s := l.pipelines, l.singles
	l.pipelines, l.singles = nil, 0
	return p, s
}

func TestRedisExistsOneRoundTrip(t *testing.T) {
	r := newRedis(t, testenv.RedisURL(t), kvstore.RedisOptions{})
	log := &pipelineLog{}
	kvstore.AddRedisHook(r, log)
	keys := testKeys(t, r, 2000)
	kvstore.ExistsPipelines(r) // forget the keys' setup
	found, err := r.Exists(context.Background(), keys)
	if err != nil {
		t.Fatal(err)
	}
	for i, f := range found {
		if f {
			t.Fatalf("Exists[%d] = true for a key never stored", i)
		}
	}
	// A single server's Exists goes over the store's own EXISTS pipeline,
	// not go-redis: no go-redis command at all, one pipeline of its own.
	pipes, singles := log.take()
	own, ok := kvstore.ExistsPipelines(r)
	if !ok || own != 1 || len(pipes) != 0 || singles != 0 {
		t.Errorf("Exists of %d keys sent %d own pipelines (pipe %v), %d go-redis pipelines %v and %d single commands; want one own pipeline",
			len(keys), own, ok, len(pipes), pipes, singles)
	}
}

func TestRedisPipelineBounds(t *testing.T) {
	const maxKeys, maxBytes, n, valueSize = 10, 1000, 95, 150
	r := newRedis(t, testenv.RedisURL(t), kvstore.RedisOptions{MaxBatchKeys: maxKeys, MaxBatchBytes: maxBytes})
	log := &pipelineLog{}
	kvstore.AddRedisHook(r, log)
	ctx := context.Background()
	keys := testKeys(t, r, n)
	items := make([]kvstore.Item, n)
	for i, k := range keys {
		items[i] = kvstore.Item{Key: k, Value: []byte(strings.Repeat(string(rune('a'+i%26)), valueSize))}
	}
	if err := putAll(r, items...); err != nil {
		t.Fatal(err)
	}
	checkPipelines(t, "Put", log, n, maxKeys, func(p pipelineStat) int { return p.argBytes }, maxBytes)
	kvstore.ExistsPipelines(r)
	if _, err := r.Exists(ctx, keys); err != nil {
		t.Fatal(err)
	}
	if own, _ := kvstore.ExistsPipelines(r); own != (n+maxKeys-1)/maxKeys {
		t.Errorf("Exists of %d keys sent %d pipelines of its own; want %d of at most %d keys", n, own, (n+maxKeys-1)/maxKeys, maxKeys)
	}
	values, errs, err := r.Get(ctx, keys)
	if err != nil {
		t.Fatal(err)
	}
	for i := range keys {
		if errs[i] != nil || string(values[i]) != string(items[i].Value) {
			t.Fatalf("Get index %d = %q, %v", i, values[i], errs[i])
		}
	}
	pipes := checkPipelines(t, "Get", log, n, maxKeys, func(p pipelineStat) int { return p.replyBytes }, maxBytes)
	// The first pipeline assumes large values (one key fits 1000 bytes);
	// later ones are sized by the 150-byte values seen: 6 keys each.
	perPipe := maxBytes / valueSize
	if want := 1 + (n-1+perPipe-1)/perPipe; len(pipes) > want {
		t.Errorf("Get sent %d pipelines, want at most %d once value sizes are known", len(pipes), want)
	}
	if _, err := r.Remove(ctx, keys); err != nil {
		t.Fatal(err)
	}
	checkPipelines(t, "Remove", log, n, maxKeys, nil, 0)
}

// checkPipelines checks that the pipelines recorded since the last check
// carried n commands in all, none over maxKeys, and, when size is given,
// none over maxBytes by that measure.
func checkPipelines(t *testing.T, op string, log *pipelineLog, n, maxKeys int, size func(pipelineStat) int, maxBytes int) []pipelineStat {
	t.Helper()
	pipes, singles := log.take()
	total := 0
	for i, p := range pipes {
		total += p.cmds
		if p.cmds > maxKeys {
			t.Errorf("%s pipeline %d holds %d commands, over %d", op, i, p.cmds, maxKeys)
		}
		if size != nil && size(p) > maxBytes {
			t.Errorf("%s pipeline %d moves %d bytes, over %d", op, i, size(p), maxBytes)
		}
	}
	if total != n || singles != 0 {
		t.Errorf("%s sent %d commands in %d pipelines and %d single commands; want %d in pipelines",
			op, total, len(pipes), singles, n)
	}
	return pipes
}

func TestRedisMaxValueBytes(t *testing.T) {
	r := newRedis(t, testenv.RedisURL(t), kvstore.RedisOptions{MaxValueBytes: 4})
	keys := testKeys(t, r, 3)
	errs, err := r.Put(context.Background(), []kvstore.Item{
		{Key: keys[0], Value: []byte("1234")},
		{Key: keys[1], Value: []byte("12345")},
		{Key: keys[2], Value: []byte("")},
	})
	if err != nil {
		t.Fatal(err)
	}
	if errs[0] != nil || !errors.Is(errs[1], kvstore.ErrTooLarge) || errs[2] != nil {
		t.Errorf("Put errors = %v, want [nil ErrTooLarge nil]", errs)
	}
	found, err := r.Exists(context.Background(), keys)
	if err != nil || fmt.Sprint(found) != "[true false true]" {
		t.Errorf("Exists = %v, %v; want [true false true]", found, err)
	}
}

func TestRedisTTL(t *testing.T) {
	url := testenv.RedisURL(t)
	const ttl = time.Hour
	tests := []struct {
		name    string
		ttl     time.Duration
		wantTTL bool
	}{
		{"with TTL", ttl, true},
		{"without TTL", 0, false},
	}
	raw := rawClient(t, url)
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			r := newRedis(t, url, kvstore.RedisOptions{TTL: tc.ttl})
			keys := testKeys(t, r, 1)
			if err := putAll(r, kvstore.Item{Key: keys[0], Value: []byte("v")}); err != nil {
				t.Fatal(err)
			}
			got, err := raw.PTTL(context.Background(), keys[0]).Result()
			if err != nil {
				t.Fatal(err)
			}
			// PTTL answers -1 (as a duration of -1 ns) for a key without expiry.
			if has := got > 0 && got <= ttl; has != tc.wantTTL || (!tc.wantTTL && got != -1) {
				t.Errorf("PTTL = %v; want expiry %v (TTL option %v)", got, tc.wantTTL, tc.ttl)
			}
		})
	}
}

func rawClient(t testing.TB, url string) *redis.Client {
	t.Helper()
	ro, err := redis.ParseURL(url)
	if err != nil {
		t.Fatal(err)
	}
	c := redis.NewClient(ro)
	t.Cleanup(func() { _ = c.Close() })
	return c
}

func TestRedisNoSpace(t *testing.T) {
	srv := testenv.StartRedis(t, "--maxmemory", "2mb", "--maxmemory-policy", "noeviction")
	r := newRedis(t, srv.URL(), kvstore.RedisOptions{})
	ctx := context.Background()
	const n = 64 // 64 × 64 KiB is twice maxmemory
	keys := testKeys(t, r, n)
	items := make([]kvstore.Item, n)
	for i, k := range keys {
		items[i] = kvstore.Item{Key: k, Value: make([]byte, 64<<10)}
	}
	errs, err := r.Put(ctx, items)
	if err != nil {
		t.Fatalf("Put: whole batch failed: %v", err)
	}
	var stored []string
	noSpace := 0
	for i, e := range errs {
		switch {
		case e == nil:
			stored = append(stored, keys[i])
		case errors.Is(e, kvstore.ErrNoSpace) && !kvstore.IsTransient(e):
			noSpace++
		default:
			t.Errorf("Put item %d: %v, want nil or ErrNoSpace (not transient)", i, e)
		}
	}
	t.Logf("%d items stored, %d answered ErrNoSpace", len(stored), noSpace)
	if noSpace == 0 {
		t.Fatalf("no ErrNoSpace after putting %d × 64 KiB into a 2 MiB server", n)
	}
	found, err := r.Exists(ctx, keys)
	if err != nil {
		t.Fatalf("Exists on a full server: %v", err)
	}
	for i, e := range errs {
		if found[i] != (e == nil) {
			t.Errorf("key %d: exists %v but put error %v", i, found[i], e)
		}
	}
	if _, err := r.Remove(ctx, stored); err != nil {
		t.Fatalf("Remove on a full server: %v", err)
	}
	if err := putAll(r, kvstore.Item{Key: keys[0], Value: []byte("small")}); err != nil {
		t.Errorf("Put after freeing space: %v", err)
	}
}

func TestRedisStoppedServer(t *testing.T) {
	srv := testenv.StartRedis(t)
	r := newRedis(t, srv.URL(), kvstore.RedisOptions{MaxRetries: -1, DialAttempts: 1, DialTimeout: time.Second})
	ctx := context.Background()
	keys := testKeys(t, r, 2)
	if err := putAll(r, kvstore.Item{Key: keys[0], Value: []byte("v")}); err != nil {
		t.Fatal(err)
	}
	srv.Stop()
	calls := map[string]func() error{
		"Exists": func() error { _, err := r.Exists(ctx, keys); return err },
		"Put":    func() error { _, err := r.Put(ctx, []kvstore.Item{{Key: keys[1]}}); return err },
		"Get":    func() error { _, _, err := r.Get(ctx, keys); return err },
		"Remove": func() error { _, err := r.Remove(ctx, keys); return err },
		"Ping":   func() error { return r.Ping(ctx) },
	}
	for name, call := range calls {
		if err := call(); !errors.Is(err, kvstore.ErrUnavailable) || !kvstore.IsTransient(err) {
			t.Errorf("%s on a stopped server: %v, want transient ErrUnavailable", name, err)
		}
	}
	_, err := kvstore.NewRedis(ctx, srv.URL(), kvstore.RedisOptions{MaxRetries: -1, DialAttempts: 1, DialTimeout: time.Second})
	if !errors.Is(err, kvstore.ErrUnavailable) {
		t.Errorf("NewRedis to a stopped server: %v, want ErrUnavailable", err)
	}
}

func TestRedisContextEndsWhileServerPaused(t *testing.T) {
	srv := testenv.StartRedis(t)
	tests := []struct {
		name        string
		readTimeout time.Duration
		ctx         func() (context.Context, context.CancelFunc)
		want        error
	}{
		// A read timeout longer than the pause: only the deadline can end the call.
		{"deadline", 30 * time.Second, func() (context.Context, context.CancelFunc) {
			return context.WithTimeout(context.Background(), 200*time.Millisecond)
		}, context.DeadlineExceeded},
		// go-redis does not watch cancellation: the read timeout ends the call.
		{"cancel", 500 * time.Millisecond, func() (context.Context, context.CancelFunc) {
			ctx, cancel := context.WithCancel(context.Background())
			time.AfterFunc(100*time.Millisecond, cancel)
			return ctx, cancel
		}, context.Canceled},
	}
	stores := make([]*kvstore.Redis, len(tests))
	for i, tc := range tests {
		stores[i] = newRedis(t, srv.URL(), kvstore.RedisOptions{ReadTimeout: tc.readTimeout, MaxRetries: -1})
	}
	// Every client's commands now wait 20 s unanswered.
	if err := rawClient(t, srv.URL()).Do(context.Background(), "CLIENT", "PAUSE", "20000", "ALL").Err(); err != nil {
		t.Fatalf("CLIENT PAUSE: %v", err)
	}
	for i, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := tc.ctx()
			defer cancel()
			_, err := stores[i].Exists(ctx, []string{"k"})
			if !errors.Is(err, tc.want) {
				t.Errorf("Exists on a paused server: %v, want %v", err, tc.want)
			}
		})
	}
}

func TestNewRedisBadURL(t *testing.T) {
	_, err := kvstore.NewRedis(context.Background(), "http://127.0.0.1:1", kvstore.RedisOptions{})
	if err == nil || errors.Is(err, kvstore.ErrUnavailable) {
		t.Errorf("NewRedis with an http URL: %v, want a URL error", err)
	}
}
