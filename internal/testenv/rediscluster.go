package testenv

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// Settings of the test Redis Cluster.
const (
	// clusterMasters is how many masters a Cluster has; each has one replica.
	clusterMasters = 3
	// clusterNodeTimeout is the nodes' cluster-node-timeout: how long a
	// master may be unreachable before its replica takes over, in ms.
	clusterNodeTimeout = "1000"
	// clusterReadyWithin bounds the wait for a new cluster to be ready:
	// all slots served, every master with a replica in sync.
	clusterReadyWithin = 60 * time.Second
	// clusterFailoverWithin bounds WaitFailover.
	clusterFailoverWithin = 60 * time.Second
	// clusterPoll is the interval between two polls of the cluster's state.
	clusterPoll = 50 * time.Millisecond
	// clusterCommandTimeout bounds one command the harness sends a node.
	clusterCommandTimeout = 2 * time.Second
	// clusterLogLines is how many lines of each node's log a failure shows.
	clusterLogLines = 20
	// clusterDirPrefix names the data directories of shared clusters in
	// os.TempDir(), followed by the test process's id.
	clusterDirPrefix = "kvmesh-rediscluster-"
)

// Cluster is a Redis Cluster of redis-server processes on loopback: three
// masters, each with one replica, no persistence, a 1 s node timeout so
// that a replica takes over a killed master within seconds. Its methods
// may be called from any goroutine.
type Cluster struct {
	dir string

	mu      sync.Mutex
	nodes   map[string]*serverProcess // by address, killed ones included
	masters []string                  // the masters serving slots, as last seen
	killed  map[string]bool
}

// sharedCluster is the cluster RedisCluster hands out, started on first use.
var sharedCluster struct {
	once sync.Once
	c    *Cluster
	err  error
}

// RedisCluster returns the cluster shared by the tests of this test binary,
// starting it on first use (see NewRedisCluster). Tests must not break it;
// they keep their keys apart by prefix, as with the shared Redis. Its nodes
// are killed when the test binary exits (they die with it; a TestMain may
// call StopRedisClusters after m.Run to remove its data too). Without
// redis-server or redis-cli on PATH the test is skipped, or fails when
// KVMESH_REQUIRE_SERVICES=1.
func RedisCluster(t testing.TB) *Cluster {
	t.Helper()
	bins := clusterBinaries(t)
	sharedCluster.once.Do(func() {
		sweepClusterDirs()
		dir := filepath.Join(os.TempDir(), clusterDirPrefix+strconv.Itoa(os.Getpid()))
		sharedCluster.c, sharedCluster.err = startCluster(bins, dir)
	})
	if sharedCluster.err != nil {
		t.Fatalf("start the shared redis cluster: %v", sharedCluster.err)
	}
	c := sharedCluster.c
	t.Cleanup(func() { c.logTailsOnFailure(t) })
	return c
}

// StopRedisClusters kills the nodes of the cluster RedisCluster started, if
// any, and removes its data, for a TestMain to call after m.Run.
func StopRedisClusters() {
	if c := sharedCluster.c; c != nil {
		c.stop()
		_ = os.RemoveAll(c.dir) // best effort: a leftover is only disk space
	}
}

// NewRedisCluster starts a private cluster for one test, which may break it
// (KillMaster): six redis-servers in cluster mode on loopback ports from
// FreeAddr, joined with `redis-cli --cluster create --cluster-replicas 1`.
// It returns once every node reports cluster_state:ok and every master has
// a replica in sync, and kills every node when the test ends, logging the
// end of each node's log when the test failed.
func NewRedisCluster(t testing.TB) *Cluster {
	t.Helper()
	bins := clusterBinaries(t)
	c, err := startCluster(bins, t.TempDir())
	if err != nil {
		t.Fatalf("start a redis cluster: %v", err)
	}
	t.Cleanup(func() {
		c.logTailsOnFailure(t)
		c.stop()
	})
	return c
}

// clusterBins are the programs a cluster needs.
type clusterBins struct{ server, cli string }

// clusterBinaries finds redis-server and redis-cli, or skips or fails t.
func clusterBinaries(t testing.TB) clusterBins {
	t.Helper()
	server, err := exec.LookPath("redis-server")
	if err != nil {
		unavailable(t, "redis-server is not on PATH (%v); install redis-server", err)
	}
	cli, err := exec.LookPath("redis-cli")
	if err != nil {
		unavailable(t, "redis-cli is not on PATH (%v); install redis-tools", err)
	}
	return clusterBins{server: server, cli: cli}
}

// startCluster starts the six nodes with data under dir, creates the
// cluster and waits until it is ready. On error it has stopped the nodes
// it started, and the error carries the ends of their logs.
func startCluster(bins clusterBins, dir string) (*Cluster, error) {
	c := &Cluster{dir: dir, nodes: map[string]*serverProcess{}, killed: map[string]bool{}}
	var addrs []string
	for i := range 2 * clusterMasters {
		s, err := startClusterNode(bins.server, filepath.Join(dir, "node"+strconv.Itoa(i)))
		if err != nil {
			c.stop()
			return nil, err
		}
		c.nodes[s.addr] = s
		addrs = append(addrs, s.addr)
	}
	fail := func(err error) (*Cluster, error) {
		err = fmt.Errorf("%w\n%s", err, c.logTails())
		c.stop()
		return nil, err
	}
	args := append(append([]string{"--cluster", "create"}, addrs...), "--cluster-replicas", "1", "--cluster-yes")
	if out, err := exec.Command(bins.cli, args...).CombinedOutput(); err != nil {
		return fail(fmt.Errorf("redis-cli --cluster create: %w\n%s", err, out))
	}
	err := pollCluster(clusterReadyWithin, func(ctx context.Context) error {
		masters, err := c.ready(ctx)
		c.setMasters(masters)
		return err
	})
	if err != nil {
		return fail(fmt.Errorf("cluster not ready: %w", err))
	}
	return c, nil
}

// startClusterNode starts one node with data in dir on a fresh port and
// cluster bus port, trying again with fresh ports when it exits before it
// answers PING (another process took a port).
func startClusterNode(bin, dir string) (*serverProcess, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("redis cluster node directory: %w", err)
	}
	for attempt := 1; ; attempt++ {
		s, err := launchClusterNode(bin, dir)
		if err != nil {
			return nil, err
		}
		err = s.waitReady(serverReadyWithin, func() error { return ping(s.addr) })
		if err == nil {
			return s, nil
		}
		s.Stop()
		if !errors.Is(err, errServerExited) || attempt == serverStartAttempts {
			return nil, fmt.Errorf("redis-server (cluster node) on %s: %w\n%s", s.addr, err, s.Output())
		}
	}
}

// launchClusterNode starts redis-server in cluster mode on two fresh
// ports, its own and its cluster bus's. It dies with the test process
// (Pdeathsig), so that a shared cluster never outlives its test binary.
func launchClusterNode(bin, dir string) (*serverProcess, error) {
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	bus, err := freePort()
	if err != nil {
		return nil, err
	}
	// A stale nodes.conf from an attempt that failed would make the node
	// rejoin as its former self.
	_ = os.Remove(filepath.Join(dir, "nodes.conf")) // absent on a first attempt
	args := []string{
		"--port", port, "--cluster-port", bus, "--bind", "127.0.0.1",
		"--save", "", "--appendonly", "no", "--dir", dir,
		"--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
		"--cluster-node-timeout", clusterNodeTimeout,
		// A replica may take over however long it has been out of touch.
		"--cluster-replica-validity-factor", "0",
		"--repl-diskless-sync", "yes", "--repl-diskless-sync-delay", "0",
	}
	s := &serverProcess{
		name: "redis-server (cluster node)", addr: "127.0.0.1:" + port,
		cmd: exec.Command(bin, args...), out: &SyncBuffer{}, done: make(chan struct{}),
	}
	s.cmd.Stdout, s.cmd.Stderr = s.out, s.out
	s.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := s.cmd.Start(); err != nil {
		return nil, fmt.Errorf("start redis-server (cluster node): %w", err)
	}
	go func() {
		_ = s.cmd.Wait() // a killed node exits with an error by design
		close(s.done)
	}()
	return s, nil
}

// URL returns the cluster's address for kvstore: redis+cluster:// followed
// by every node's address, killed ones included (a client skips those).
func (c *Cluster) URL() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return "redis+cluster://" + strings.Join(slices.Sorted(maps.Keys(c.nodes)), ",")
}

// Masters returns the addresses of the masters serving slots, as last
// seen: when the cluster became ready, or after WaitFailover.
func (c *Cluster) Masters() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.masters)
}

// KillMaster kills the node at addr with SIGKILL, as a crash would; the
// test fails when addr is not a master of the cluster.
func (c *Cluster) KillMaster(t testing.TB, addr string) {
	t.Helper()
	c.mu.Lock()
	s := c.nodes[addr]
	isMaster := slices.Contains(c.masters, addr)
	if s != nil && isMaster {
		c.killed[addr] = true
	}
	c.mu.Unlock()
	if s == nil || !isMaster {
		t.Fatalf("KillMaster(%s): not a master of the cluster (masters %v)", addr, c.Masters())
	}
	s.Stop()
	t.Logf("redis cluster: killed master %s", addr)
}

// WaitFailover polls, for up to 60 s, until the master killed at killed has
// been replaced: every live node reports cluster_state:ok and all 16384
// slots are served by live masters. Masters then reports the new masters.
func (c *Cluster) WaitFailover(t testing.TB, killed string) {
	t.Helper()
	start := time.Now()
	err := pollCluster(clusterFailoverWithin, func(ctx context.Context) error {
		masters, err := c.servingMasters(ctx)
		if err != nil {
			return err
		}
		if slices.Contains(masters, killed) {
			return fmt.Errorf("killed master %s still serves slots", killed)
		}
		if err := c.eachLive(ctx, clusterStateOK); err != nil {
			return err
		}
		c.setMasters(masters)
		return nil
	})
	if err != nil {
		t.Fatalf("redis cluster: no failover of %s: %v\n%s", killed, err, c.logTails())
	}
	t.Logf("redis cluster: %s replaced after %v; masters %v", killed, time.Since(start).Round(time.Millisecond), c.Masters())
}

// MasterOf returns the address of the master that serves key's slot now.
func (c *Cluster) MasterOf(t testing.TB, key string) string {
	t.Helper()
	var master string
	err := c.withLiveNode(func(ctx context.Context, n *redis.Client) error {
		slot, err := n.ClusterKeySlot(ctx, key).Result()
		if err != nil {
			return err
		}
		slots, err := n.ClusterSlots(ctx).Result()
		if err != nil {
			return err
		}
		for _, s := range slots {
			if int64(s.Start) <= slot && slot <= int64(s.End) && len(s.Nodes) > 0 {
				master = s.Nodes[0].Addr
				return nil
			}
		}
		return fmt.Errorf("slot %d is not served", slot)
	})
	if err != nil {
		t.Fatalf("redis cluster: master of %q: %v", key, err)
	}
	return master
}

// ready checks that every node reports cluster_state:ok and knows all
// nodes, that three masters serve all slots, and that each has a replica
// whose link is up; it returns the masters.
func (c *Cluster) ready(ctx context.Context) ([]string, error) {
	if err := c.eachLive(ctx, func(ctx context.Context, n *redis.Client) error {
		if err := clusterStateOK(ctx, n); err != nil {
			return err
		}
		return clusterSynced(ctx, n)
	}); err != nil {
		return nil, err
	}
	masters, err := c.servingMasters(ctx)
	if err != nil {
		return nil, err
	}
	if len(masters) != clusterMasters {
		return nil, fmt.Errorf("%d masters serve slots, want %d", len(masters), clusterMasters)
	}
	return masters, nil
}

// clusterStateOK checks CLUSTER INFO on one node: state ok, all slots
// assigned and served.
func clusterStateOK(ctx context.Context, n *redis.Client) error {
	info, err := n.ClusterInfo(ctx).Result()
	if err != nil {
		return fmt.Errorf("%s: cluster info: %w", n.Options().Addr, err)
	}
	if f := infoFields(info); f["cluster_state"] != "ok" || f["cluster_slots_ok"] != "16384" {
		return fmt.Errorf("%s: cluster_state:%s, cluster_slots_ok:%s", n.Options().Addr, f["cluster_state"], f["cluster_slots_ok"])
	}
	return nil
}

// clusterSynced checks INFO replication on one node: a master has a replica
// online, a replica has its master link up and is not syncing.
func clusterSynced(ctx context.Context, n *redis.Client) error {
	info, err := n.Info(ctx, "replication").Result()
	if err != nil {
		return fmt.Errorf("%s: info replication: %w", n.Options().Addr, err)
	}
	fields := infoFields(info)
	switch fields["role"] {
	case "master":
		if fields["connected_slaves"] != "1" || !strings.Contains(fields["slave0"], "state=online") {
			return fmt.Errorf("%s: master without a replica online (%q)", n.Options().Addr, fields["slave0"])
		}
	case "slave":
		if fields["master_link_status"] != "up" || fields["master_sync_in_progress"] != "0" {
			return fmt.Errorf("%s: replica not in sync (link %q)", n.Options().Addr, fields["master_link_status"])
		}
	default:
		return fmt.Errorf("%s: role %q", n.Options().Addr, fields["role"])
	}
	return nil
}

// infoFields parses the name:value lines of an INFO reply.
func infoFields(info string) map[string]string {
	fields := map[string]string{}
	for line := range strings.SplitSeq(info, "\n") {
		if k, v, ok := strings.Cut(strings.TrimSpace(line), ":"); ok {
			fields[k] = v
		}
	}
	return fields
}

// servingMasters asks every live node for the masters that serve slots
// and returns them, sorted, when all nodes agree and the slots of all
// 16384 are covered.
func (c *Cluster) servingMasters(ctx context.Context) ([]string, error) {
	var agreed []string
	err := c.eachLive(ctx, func(ctx context.Context, n *redis.Client) error {
		slots, err := n.ClusterSlots(ctx).Result()
		if err != nil {
			return fmt.Errorf("%s: cluster slots: %w", n.Options().Addr, err)
		}
		covered := 0
		var masters []string
		for _, s := range slots {
			if len(s.Nodes) == 0 {
				continue
			}
			covered += s.End - s.Start + 1
			if !slices.Contains(masters, s.Nodes[0].Addr) {
				masters = append(masters, s.Nodes[0].Addr)
			}
		}
		slices.Sort(masters)
		if covered != 16384 {
			return fmt.Errorf("%s: %d of 16384 slots served", n.Options().Addr, covered)
		}
		if agreed != nil && !slices.Equal(agreed, masters) {
			return fmt.Errorf("nodes disagree on the masters: %v and %v", agreed, masters)
		}
		agreed = masters
		return nil
	})
	return agreed, err
}

// eachLive runs check on a client of every node not killed, in address
// order, and returns the first error.
func (c *Cluster) eachLive(ctx context.Context, check func(context.Context, *redis.Client) error) error {
	for _, addr := range c.liveAddrs() {
		n := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1, DialTimeout: clusterCommandTimeout, ReadTimeout: clusterCommandTimeout})
		err := check(ctx, n)
		_ = n.Close() // closing a client of a test's own node
		if err != nil {
			return err
		}
	}
	return nil
}

// withLiveNode runs f on a client of the first live node that answers it
// without error, within the command timeout.
func (c *Cluster) withLiveNode(f func(context.Context, *redis.Client) error) error {
	ctx, cancel := context.WithTimeout(context.Background(), clusterCommandTimeout)
	defer cancel()
	var errs []error
	for _, addr := range c.liveAddrs() {
		n := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1})
		err := f(ctx, n)
		_ = n.Close() // closing a client of a test's own node
		if err == nil {
			return nil
		}
		errs = append(errs, fmt.Errorf("%s: %w", addr, err))
	}
	return errors.Join(errs...)
}

// liveAddrs returns the addresses of the nodes not killed, sorted.
func (c *Cluster) liveAddrs() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	var addrs []string
	for a := range c.nodes {
		if !c.killed[a] {
			addrs = append(addrs, a)
		}
	}
	slices.Sort(addrs)
	return addrs
}

func (c *Cluster) setMasters(masters []string) {
	if masters == nil {
		return
	}
	c.mu.Lock()
	c.masters = masters
	c.mu.Unlock()
}

// pollCluster calls check every 50 ms, each call bounded by the command
// timeout, until it answers nil or within passes; it returns check's last
// error then.
func pollCluster(within time.Duration, check func(context.Context) error) error {
	deadline := time.Now().Add(within)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), clusterCommandTimeout)
		err := check(ctx)
		cancel()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("not within %v: %w", within, err)
		}
		time.Sleep(clusterPoll) // the poll interval, not synchronisation: the deadline decides
	}
}

// stop kills every node and waits until each has exited.
func (c *Cluster) stop() {
	c.mu.Lock()
	nodes := make([]*serverProcess, 0, len(c.nodes))
	for _, s := range c.nodes {
		nodes = append(nodes, s)
	}
	c.mu.Unlock()
	var wg sync.WaitGroup
	for _, s := range nodes {
		wg.Go(s.Stop)
	}
	wg.Wait()
}

// logTailsOnFailure logs the end of every node's log when t failed.
func (c *Cluster) logTailsOnFailure(t testing.TB) {
	if t.Failed() {
		t.Log(c.logTails())
	}
}

// logTails returns the last lines of every node's log, by address.
func (c *Cluster) logTails() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	var sb strings.Builder
	for _, a := range slices.Sorted(maps.Keys(c.nodes)) {
		lines := strings.Split(strings.TrimRight(c.nodes[a].Output(), "\n"), "\n")
		fmt.Fprintf(&sb, "--- redis cluster node %s log (last lines) ---\n%s\n", a,
			strings.Join(lines[max(0, len(lines)-clusterLogLines):], "\n"))
	}
	return sb.String()
}

// sweepClusterDirs removes the data directories of shared clusters whose
// test processes no longer exist; it leaves anything it cannot judge.
func sweepClusterDirs() {
	dirs, _ := filepath.Glob(filepath.Join(os.TempDir(), clusterDirPrefix+"*")) // only ErrBadPattern, impossible here
	for _, dir := range dirs {
		pid, err := strconv.Atoi(strings.TrimPrefix(filepath.Base(dir), clusterDirPrefix))
		if err != nil || pid <= 0 || pid == os.Getpid() {
			continue
		}
		if errors.Is(syscall.Kill(pid, 0), syscall.ESRCH) {
			_ = os.RemoveAll(dir) // best effort: a leftover is only disk space
		}
	}
}
