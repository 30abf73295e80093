package evictions

// The watcher of a Redis Cluster. Keyspace notifications are node-local in
// a cluster (a key's removal is published on the node that held it, and
// SUBSCRIBE through any node hears that node's only), so the watcher runs
// one session, as on a single server, on every master:
//
//   - Every TopologyEvery it reloads the cluster's slot map (go-redis's
//     ClusterClient.ForEachMaster, which reads CLUSTER SLOTS from a node
//     that answers) and reconciles: a new master (a promoted replica, a
//     node added) gets a session of its own, a node that is no longer a
//     master (demoted, removed) is let go. Replicas are not watched: they
//     replay their master's removals, which would announce each twice.
//   - Each master's session is retried with backoff on its own; a lost
//     subscription is a gap, as on a single server, and so is a master
//     that appears after the first reconcile (its removals since it became
//     master went unheard). A master that is down never stops the others
//     nor the sender.
//   - With Options.Configure, each master's notify-keyspace-events is set
//     with CONFIG SET when its session starts: a promoted replica is
//     configured as it is subscribed.
//   - FLUSHALL is per node: each master has a marker key of its own, whose
//     hash tag puts it in one of the master's slots, and a marker found
//     gone unannounced clears the whole deployment (AllBlocksCleared): the
//     router then believes less is stored, never more. A replica promoted
//     after a failover holds its master's marker (replicated) under the
//     same name; a marker lost with its master is set anew, not taken for
//     a flush.
//
// Keys a failover loses (writes the replica had not received) vanish
// without any notification and are not announced: a router that indexed
// them keeps them; kvmesh's lookup checks the store, so it misses them,
// and a load planned before the failover fails as a load error, which the
// engine recomputes. A slot
// migration (resharding) deletes the moved keys from their old node with
// del notifications, so they are announced as removed although they still
// exist: the router again believes less, never more.

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/kvmesh/kvmesh/pkg/retry"
)

// Settings of the cluster watcher.
const (
	// topologyTimeout bounds one reload of the cluster's slot map.
	topologyTimeout = 5 * time.Second
	// maxMarkerTags bounds the hash tags tried to find a master's marker
	// slot; a master serving one slot in 16384 needs about 16384 tries.
	maxMarkerTags = 1 << 20
)

// nodeRun is the running watch of one master.
type nodeRun struct {
	node   *node
	cancel context.CancelFunc
	done   chan struct{}
	// subscribed is set once the master's first subscription is confirmed.
	subscribed atomic.Bool
}

// clusterWatch is one leadership's watch of the cluster's masters.
type clusterWatch struct {
	w    *Watcher
	ctx  context.Context
	runs map[string]*nodeRun
	// kick wakes the loop when a master subscribes (to close Ready).
	kick chan struct{}
	// fatal receives a master's ErrNotifyDisabled before the watcher ever
	// ran: the sender must not start.
	fatal chan error
	// known is set once the masters were read once.
	known bool
	// unreadable is set while reading the masters fails (logged once).
	unreadable bool
}

// watchCluster watches every master of the cluster until ctx ends, or
// until a master refuses the notifications before the watcher ever ran
// (the error, wrapping ErrNotifyDisabled). subscribed reports whether any
// master was subscribed.
func (w *Watcher) watchCluster(ctx context.Context) (subscribed bool, err error) {
	ctx, cancel := context.WithCancel(ctx)
	cw := &clusterWatch{w: w, ctx: ctx, runs: map[string]*nodeRun{}, kick: make(chan struct{}, 1), fatal: make(chan error, 1)}
	defer func() {
		cancel()
		for _, r := range cw.runs {
			<-r.done
		}
	}()
	tick := time.NewTicker(w.opts.TopologyEvery)
	defer tick.Stop()
	reload := true
	for {
		if reload {
			cw.reconcile()
		}
		cw.checkReady()
		select {
		case <-ctx.Done():
			return cw.anySubscribed(), nil
		case err := <-cw.fatal:
			return cw.anySubscribed(), err
		case <-cw.kick:
			reload = false
		case <-tick.C:
			reload = true
		}
	}
}

// masters reads the cluster's masters: their addresses and the cluster
// client's clients of them.
func (w *Watcher) masters(ctx context.Context) (map[string]*redis.Client, error) {
	ctx, cancel := context.WithTimeout(ctx, topologyTimeout)
	defer cancel()
	var mu sync.Mutex
	out := map[string]*redis.Client{}
	err := w.cluster.ForEachMaster(ctx, func(_ context.Context, c *redis.Client) error {
		mu.Lock()
		defer mu.Unlock()
		out[c.Options().Addr] = c
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("read cluster masters: %w", err)
	}
	return out, nil
}

// reconcile starts a watch of every new master and stops those of nodes
// that are no longer masters. A cluster that does not answer changes
// nothing: every master's own session retries.
func (cw *clusterWatch) reconcile() {
	w := cw.w
	masters, err := w.masters(cw.ctx)
	if err != nil {
		if cw.ctx.Err() == nil && !cw.unreadable {
			w.opts.Logger.Warn("store removal watcher cannot read the cluster's masters; keeping the known ones", "err", err)
		}
		cw.unreadable = true
		return
	}
	cw.unreadable = false
	for _, addr := range slices.Sorted(maps.Keys(cw.runs)) {
		if _, ok := masters[addr]; !ok {
			r := cw.runs[addr]
			r.cancel()
			<-r.done
			delete(cw.runs, addr)
			w.opts.Logger.Info("store removal watcher let go of a node that is no longer a cluster master", "node", addr)
		}
	}
	for _, addr := range slices.Sorted(maps.Keys(masters)) {
		if _, ok := cw.runs[addr]; ok {
			continue
		}
		if cw.known {
			w.opts.Metrics.gaps.Inc()
			w.opts.Logger.Warn("store removal watcher found a new cluster master: its removals until it is subscribed are not announced", "node", addr)
		}
		cw.start(addr, masters[addr])
	}
	cw.known = true
}

// start runs the watch of the master at addr through the cluster client's
// client of it (its subscription takes a connection of its own). That
// client's options are the cluster's; the cluster client closes it, once
// the node is out of its slot map for a while or at Close, never while
// the node is a master.
func (cw *clusterWatch) start(addr string, client *redis.Client) {
	w := cw.w
	ctx, cancel := context.WithCancel(cw.ctx)
	r := &nodeRun{cancel: cancel, done: make(chan struct{})}
	r.node = &node{
		addr: addr, client: client,
		pickMarker: func(ctx context.Context) (string, error) { return w.clusterMarker(ctx, addr) },
		onSubscribed: func() {
			r.subscribed.Store(true)
			select {
			case cw.kick <- struct{}{}:
			default:
			}
		},
	}
	cw.runs[addr] = r
	go func() {
		defer close(r.done)
		if err := w.watchNode(ctx, r.node); err != nil {
			select {
			case cw.fatal <- err:
			default:
			}
		}
	}()
}

// watchNode runs sessions on n until ctx ends, reconnecting with backoff;
// it returns an error only when n refuses the notifications before the
// watcher ever ran (see ended).
func (w *Watcher) watchNode(ctx context.Context, n *node) error {
	for attempt := 1; ctx.Err() == nil; {
		subscribed, err := w.session(ctx, n)
		if ctx.Err() != nil {
			return nil
		}
		if err := w.ended(n.addr, subscribed, err); err != nil {
			return err
		}
		attempt = nextAttempt(attempt, subscribed)
		if err := retry.Sleep(ctx, w.opts.Backoff.Delay(attempt)); err != nil {
			return nil
		}
	}
	return nil
}

// checkReady closes Ready once every master found has been subscribed.
func (cw *clusterWatch) checkReady() {
	if cw.w.started() || len(cw.runs) == 0 {
		return
	}
	for _, r := range cw.runs {
		if !r.subscribed.Load() {
			return
		}
	}
	cw.w.markReady()
}

// anySubscribed reports whether any master's watch ever subscribed.
func (cw *clusterWatch) anySubscribed() bool {
	for _, r := range cw.runs {
		if r.subscribed.Load() {
			return true
		}
	}
	return false
}

// clusterMarker finds the marker key of the master at addr: the first of
// "kvmesh-evictions-marker@{N}[prefix@]model", N = 0, 1, …, whose slot
// the master serves in the cluster client's slot map. Its hash tag {N}
// picks the slot (go-redis's slot function is internal, so the tags are
// tried through MasterForKey rather than computed).
func (w *Watcher) clusterMarker(ctx context.Context, addr string) (string, error) {
	for i := range maxMarkerTags {
		key := clusterMarkerKey(w.scope(), i)
		c, err := w.cluster.MasterForKey(ctx, key)
		if err != nil {
			return "", fmt.Errorf("find the marker slot of %s: %w", addr, err)
		}
		if c.Options().Addr == addr {
			return key, nil
		}
	}
	return "", fmt.Errorf("find the marker slot of %s: the slot map gives it no slot", addr)
}

// clusterMarkerKey is the marker key of hash tag i: outside the
// deployment's key space and never a store key, as markerKey.
func clusterMarkerKey(scope string, i int) string {
	return markerPrefix + "{" + strconv.Itoa(i) + "}" + scope
}
