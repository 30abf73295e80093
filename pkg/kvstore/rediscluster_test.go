package kvstore_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/kvmesh/kvmesh/internal/kvstoretest"
	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
)

func TestRedisClusterContract(t *testing.T) {
	url := testenv.RedisCluster(t).URL()
	opts := map[string]kvstore.RedisOptions{
		"Defaults":       {},
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

// nodeLog counts, per node address, the data commands a cluster store's
// node clients were sent in pipelines.
type nodeLog struct {
	mu   sync.Mutex
	cmds map[string]int
}

// hook returns the go-redis hook of the node at addr.
func (l *nodeLog) hook(addr string) redis.Hook { return nodeHook{l: l, addr: addr} }

func (l *nodeLog) take() map[string]int {
	l.mu.Lock()
	defer l.mu.Unlock()
	c := l.cmds
	l.cmds = map[string]int{}
	return c
}

type nodeHook struct {
	l    *nodeLog
	addr string
}

func (h nodeHook) DialHook(next redis.DialHook) redis.DialHook          { return next }
func (h nodeHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook { return next }

func (h nodeHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		n := 0
		for _, cmd := range cmds {
			if dataCommands[cmd.Name()] {
				n++
			}
		}
		h.l.mu.Lock()
		h.l.cmds[h.addr] += n
		h.l.mu.Unlock()
		return next(ctx, cmds)
	}
}

func TestRedisClusterBatchSpansMasters(t *testing.T) {
	c := testenv.RedisCluster(t)
	r := newRedis(t, c.URL(), kvstore.RedisOptions{})
	ctx := context.Background()
	log := &nodeLog{cmds: map[string]int{}}
	if err := kvstore.AddRedisNodeHook(ctx, r, log.hook); err != nil {
		t.Fatal(err)
	}
	const n = 300
	keys := testKeys(t, r, n)
	owners := map[string]int{}
	for _, k := range keys[:60] {
		owners[c.MasterOf(t, k)]++
	}
	if len(owners) != len(c.Masters()) {
		t.Fatalf("the first 60 keys live on %d masters %v; want all of %v", len(owners), owners, c.Masters())
	}
	// Every other key is written, each with a value of its own.
	var items []kvstore.Item
	for i := 0; i < n; i += 2 {
		items = append(items, kvstore.Item{Key: keys[i], Value: fmt.Appendf(nil, "value %d of %s", i, keys[i])})
	}
	if err := putAll(r, items...); err != nil {
		t.Fatal(err)
	}
	checkNodes(t, "Put", log, c.Masters(), n/2)
	found, err := r.Exists(ctx, keys)
	if err != nil {
		t.Fatal(err)
	}
	checkNodes(t, "Exists", log, c.Masters(), n)
	values, errs, err := r.Get(ctx, keys)
	if err != nil {
		t.Fatal(err)
	}
	checkNodes(t, "Get", log, c.Masters(), n)
	for i := range keys {
		want := fmt.Appendf(nil, "value %d of %s", i, keys[i])
		switch {
		case i%2 == 1 && (found[i] || !errors.Is(errs[i], kvstore.ErrNotFound) || values[i] != nil):
			t.Errorf("key %d (never written): exists %v, Get %q %v", i, found[i], values[i], errs[i])
		case i%2 == 0 && (!found[i] || errs[i] != nil || !bytes.Equal(values[i], want)):
			t.Errorf("key %d: exists %v, Get %q %v; want %q", i, found[i], values[i], errs[i], want)
		}
	}
	rerrs, err := r.Remove(ctx, keys)
	if err != nil {
		t.Fatal(err)
	}
	for i, e := range rerrs {
		if (i%2 == 0) != (e == nil) {
			t.Errorf("Remove key %d: %v", i, e)
		}
	}
}

// checkNodes checks that the data commands sent since the last check, n in
// all, went to the masters only and to every one of them.
func checkNodes(t *testing.T, op string, log *nodeLog, masters []string, n int) {
	t.Helper()
	got := log.take()
	total := 0
	for addr, k := range got {
		total += k
		if !slices.Contains(masters, addr) && k > 0 {
			t.Errorf("%s sent %d commands to %s, not a master", op, k, addr)
		}
	}
	for _, m := range masters {
		if got[m] == 0 {
			t.Errorf("%s sent nothing to master %s (per node: %v)", op, m, got)
		}
	}
	if total != n {
		t.Errorf("%s sent %d data commands to the nodes, want %d", op, total, n)
	}
}

// failoverFingerprint is the model fingerprint of the failover test's values.
const failoverFingerprint = "failover-test-fp"

// failoverBatch is how many keys each Put of the failover test writes.
const failoverBatch = 8

// failoverPayload is the payload size of the failover test's values.
const failoverPayload = 1 << 10

// failoverKey is the key of the failover test's n-th value.
func failoverKey(prefix [6]byte, n int) string {
	return fmt.Sprintf("kvstore-failover-%x@test-model@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@%016x", prefix, n)
}

// failoverValue is the framed value of the failover test's n-th key: a
// payload that differs per key, with its checksum and fingerprint.
func failoverValue(n int) []byte {
	payload := make([]byte, failoverPayload)
	for i := range payload {
		payload[i] = byte(n*131 + i*7 + n>>8)
	}
	return dataplane.EncodeValue(failoverFingerprint, payload)
}

// putLedger records what each key's Put answered, by key index.
type putLedger struct {
	prefix [6]byte
	mu     sync.Mutex
	acked  []int // keys whose Put returned nil, in order
	failed []int // keys whose Put (or whole batch) returned an error
}

func (l *putLedger) record(first int, errs []error, batchErr error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for i := range failoverBatch {
		if batchErr == nil && errs[i] == nil {
			l.acked = append(l.acked, first+i)
		} else {
			l.failed = append(l.failed, first+i)
		}
	}
}

// lastAcked returns up to n of the keys acknowledged last.
func (l *putLedger) lastAcked(n int) []int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.acked[max(0, len(l.acked)-n):])
}

func (l *putLedger) keys(idx []int) []string {
	keys := make([]string, len(idx))
	for i, n := range idx {
		keys[i] = failoverKey(l.prefix, n)
	}
	return keys
}

// TestRedisClusterFailover kills a master while framed values are being
// put and read, and checks that no Put is silently lost and no Get returns
// wrong bytes: every acknowledged key reads back byte-exact, or, when it
// lived on the killed master and had not reached its replica, ErrNotFound.
func TestRedisClusterFailover(t *testing.T) {
	c := testenv.NewRedisCluster(t)
	opts := kvstore.RedisOptions{DialTimeout: 500 * time.Millisecond, ReadTimeout: time.Second, DialAttempts: 1}
	r := newRedis(t, c.URL(), opts)
	before := c.Masters()
	ledger := &putLedger{}
	_, _ = rand.Read(ledger.prefix[:]) // crypto/rand.Read never fails
	var killed atomic.Bool
	warm, stop := make(chan struct{}), make(chan struct{})
	var wg sync.WaitGroup
	var putErrs, getTransient, wrong atomic.Int64
	wg.Go(func() { failoverWriter(t, r, ledger, warm, stop, &putErrs) })
	wg.Go(func() { failoverReader(t, r, ledger, &killed, stop, &getTransient, &wrong) })
	var stopOnce sync.Once
	halt := func() {
		stopOnce.Do(func() { close(stop) })
		wg.Wait()
	}
	t.Cleanup(halt) // before the store closes, should the test end early
	select {
	case <-warm:
	case <-time.After(30 * time.Second):
		t.Fatal("the writer did not get 50 batches stored within 30 s")
	}
	victim := before[0]
	killed.Store(true)
	c.KillMaster(t, victim)
	c.WaitFailover(t, victim)
	promoted := onlyNew(c.Masters(), before)
	// Go on writing until a Put lands on every master again.
	waitClusterWrites(t, r, ledger.prefix)
	halt()
	verifyAfterFailover(t, c, r, ledger, promoted, &wrong)
	t.Logf("%d put errors, %d transient get errors during the failover", putErrs.Load(), getTransient.Load())
	if w := wrong.Load(); w != 0 {
		t.Errorf("%d Get results had wrong bytes", w)
	}
}

// failoverWriter puts batches of framed values under fresh keys until stop
// closes, recording each result; it closes warm after 50 batches.
func failoverWriter(t *testing.T, r kvstore.Store, ledger *putLedger, warm, stop chan struct{}, putErrs *atomic.Int64) {
	for b := 0; ; b++ {
		select {
		case <-stop:
			return
		default:
		}
		if b == 50 {
			close(warm)
		}
		items := make([]kvstore.Item, failoverBatch)
		for i := range items {
			n := b*failoverBatch + i
			items[i] = kvstore.Item{Key: failoverKey(ledger.prefix, n), Value: failoverValue(n)}
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		errs, err := r.Put(ctx, items)
		cancel()
		switch {
		case err != nil && !kvstore.IsTransient(err):
			t.Errorf("Put batch %d: %v, want a transient whole-batch error", b, err)
		case err != nil:
			putErrs.Add(1)
		}
		for i, e := range errs {
			if e != nil {
				putErrs.Add(1)
				if !kvstore.IsTransient(e) {
					t.Errorf("Put batch %d item %d: %v, want a transient error", b, i, e)
				}
			}
		}
		ledger.record(b*failoverBatch, errs, err)
	}
}

// failoverReader gets acknowledged keys until stop closes: each answer must
// be the exact value, a transient error, or — once the master was killed —
// ErrNotFound.
func failoverReader(t *testing.T, r kvstore.Store, ledger *putLedger, killed *atomic.Bool, stop chan struct{}, transient, wrong *atomic.Int64) {
	for {
		select {
		case <-stop:
			return
		default:
		}
		idx := ledger.lastAcked(64)
		keys := ledger.keys(idx)
		afterKill := killed.Load()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		values, errs, err := r.Get(ctx, keys)
		cancel()
		if err != nil {
			if !kvstore.IsTransient(err) {
				t.Errorf("Get: %v, want a transient whole-batch error", err)
			}
			transient.Add(1)
			continue
		}
		for i, k := range keys {
			switch {
			case errs[i] == nil:
				checkFramed(t, k, values[i], failoverValue(idx[i]), wrong)
			case kvstore.IsTransient(errs[i]):
				transient.Add(1)
			case errors.Is(errs[i], kvstore.ErrNotFound) && afterKill:
			default:
				t.Errorf("Get %s: %v", k, errs[i])
			}
		}
	}
}

// checkFramed counts and reports a value that is not byte-exact or does not
// decode under the test's fingerprint.
func checkFramed(t *testing.T, key string, got, want []byte, wrong *atomic.Int64) {
	t.Helper()
	_, derr := dataplane.DecodeValue(failoverFingerprint, got)
	if !bytes.Equal(got, want) || derr != nil {
		wrong.Add(1)
		t.Errorf("Get %s: %d bytes that differ from the %d put (decode: %v)", key, len(got), len(want), derr)
	}
}

// onlyNew returns the one master in after that is not in before.
func onlyNew(after, before []string) string {
	for _, m := range after {
		if !slices.Contains(before, m) {
			return m
		}
	}
	return ""
}

// waitClusterWrites polls, for up to 30 s, until one batch of keys that
// span all masters is stored and read back whole: the store has found the
// new master.
func waitClusterWrites(t *testing.T, r kvstore.Store, prefix [6]byte) {
	t.Helper()
	items := make([]kvstore.Item, 64)
	keys := make([]string, len(items))
	for i := range items {
		keys[i] = fmt.Sprintf("kvstore-failover-%x-probe@%d", prefix, i)
		items[i] = kvstore.Item{Key: keys[i], Value: []byte(keys[i])}
	}
	start := time.Now()
	deadline := start.Add(30 * time.Second)
	tick := time.NewTicker(50 * time.Millisecond) // the poll interval; the deadline decides
	defer tick.Stop()
	var last error
	for time.Now().Before(deadline) {
		// A probe an earlier attempt stored is present (ErrExists); getAll
		// checks every value.
		if last = putAll(r, items...); last == nil || errors.Is(last, kvstore.ErrExists) {
			if last = getAll(r, items); last == nil {
				_, _ = r.Remove(context.Background(), keys) // probes; the cluster is private to the test
				t.Logf("the store wrote to every master %v after the failover", time.Since(start).Round(time.Millisecond))
				return
			}
		}
		<-tick.C
	}
	t.Fatalf("the store did not recover within 30 s of the failover: %v", last)
}

// getAll checks that every item reads back exactly.
func getAll(r kvstore.Store, items []kvstore.Item) error {
	keys := make([]string, len(items))
	for i, it := range items {
		keys[i] = it.Key
	}
	values, errs, err := r.Get(context.Background(), keys)
	if err != nil {
		return err
	}
	for i, it := range items {
		if errs[i] != nil || !bytes.Equal(values[i], it.Value) {
			return fmt.Errorf("get %s: %q, %v", it.Key, values[i], errs[i])
		}
	}
	return nil
}

// verifyAfterFailover reads every key written: an acknowledged key is
// byte-exact, or ErrNotFound on the promoted master's slots (written to
// the killed master and not replicated); a key whose Put failed is
// byte-exact (it may have been applied) or ErrNotFound.
func verifyAfterFailover(t *testing.T, c *testenv.Cluster, r kvstore.Store, ledger *putLedger, promoted string, wrong *atomic.Int64) {
	t.Helper()
	ledger.mu.Lock()
	acked, failed := slices.Clone(ledger.acked), slices.Clone(ledger.failed)
	ledger.mu.Unlock()
	lost, applied := 0, 0
	for _, group := range []struct {
		idx   []int
		acked bool
	}{{acked, true}, {failed, false}} {
		keys := ledger.keys(group.idx)
		values, errs, err := r.Get(context.Background(), keys)
		if err != nil {
			t.Fatalf("Get after the failover: %v", err)
		}
		for i, k := range keys {
			switch {
			case errs[i] == nil:
				checkFramed(t, k, values[i], failoverValue(group.idx[i]), wrong)
				if !group.acked {
					applied++
				}
			case !errors.Is(errs[i], kvstore.ErrNotFound):
				t.Errorf("Get %s after the failover: %v", k, errs[i])
			case group.acked && c.MasterOf(t, k) != promoted:
				t.Errorf("acknowledged key %s is gone but lived on a master that was not killed", k)
			case group.acked:
				lost++
			}
		}
		if _, err := r.Remove(context.Background(), keys); err != nil {
			t.Errorf("cleanup: %v", err)
		}
	}
	t.Logf("after the failover: %d of %d acknowledged keys lost (not replicated), %d of %d failed puts applied",
		lost, len(acked), applied, len(failed))
}
