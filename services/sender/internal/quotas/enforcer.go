package quotas

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/kvmesh/kvmesh/pkg/adminapi"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
	"github.com/kvmesh/kvmesh/services/sender/internal/sendpolicy"
)

// Defaults of an Enforcer.
const (
	// DefaultRefresh is how often an Enforcer reads the table again (other
	// replicas' changes) and updates the usage on /metrics.
	DefaultRefresh = 5 * time.Second
	// seenFor is how long a tenant without a quota keeps its usage series
	// after its last save.
	seenFor = time.Hour
	// maxSeen bounds the tenants without a quota whose usage is shown.
	maxSeen = 1024
	// Candidate counts: a removal looks at candidatesPerKey times the keys
	// it must free, within [minCandidates, maxCandidates].
	candidatesPerKey = 4
	minCandidates    = 64
	maxCandidates    = 4096
)

// Space is one store namespace of a tenant and the size of its values.
type Space struct {
	Namespace  string
	ValueBytes int64
}

// SpacesOf lists a tenant's store namespaces in every served model:
// each group's namespaces (kvcore.Model.Namespaces), each value the
// group's bytes per block framed with the model's fingerprint
// (valueOverhead(len(fingerprint)) bytes more).
func SpacesOf(models *kvcore.Models, valueOverhead func(int) int) func(tenant string) []Space {
	return func(tenant string) []Space {
		var out []Space
		for _, m := range models.All() {
			kb, _ := models.Keys(m.Name) // every served model has keys
			tkb := kb.ForTenant(tenant)
			for g, grp := range m.Groups {
				size := grp.BytesPerBlock + int64(valueOverhead(len(kb.Fingerprint)))
				for _, r := range m.Namespaces(g) {
					out = append(out, Space{Namespace: tkb.Namespace(r, g), ValueBytes: size})
				}
			}
		}
		return out
	}
}

// Options configures an Enforcer.
type Options struct {
	// Table holds the quotas.
	Table *Table
	// Store is the store pool's quota side and StoreTimes its store-time
	// indexes (a *kvstore.Redis is both).
	Store      kvstore.Quotas
	StoreTimes kvstore.StoreTimes
	// Spaces lists a tenant's namespaces (SpacesOf).
	Spaces func(tenant string) []Space
	// Metrics, from NewMetrics.
	Metrics *Metrics
	Logger  *slog.Logger
	// Refresh is how often Run reads the table and updates the usage
	// series (0: DefaultRefresh).
	Refresh time.Duration
	// Now is the clock (nil: time.Now).
	Now func() time.Time
}

// Enforcer keeps the tenants within their quotas. It is safe for
// concurrent use.
type Enforcer struct {
	opts Options

	mu       sync.Mutex
	quotas   map[string]Quota
	reserved map[string]sendpolicy.Usage
	seen     map[string]time.Time
	evicted  map[string]int64
	skipped  map[string]int64
	shown    map[string]bool // tenants with usage series
	// admitting holds a lock per tenant with a quota, taken by Admit from
	// its usage read to its reservation: two admissions that read the
	// same usage would each evict the same blocks and admit as many.
	admitting sync.Map // tenant → *sync.Mutex
}

// New returns an Enforcer with no quota loaded (Load or Run reads them).
func New(opts Options) (*Enforcer, error) {
	if opts.Table == nil || opts.Store == nil || opts.Spaces == nil || opts.Metrics == nil {
		return nil, errors.New("quotas: Table, Store, Spaces and Metrics are required")
	}
	if opts.Refresh <= 0 {
		opts.Refresh = DefaultRefresh
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	return &Enforcer{opts: opts, quotas: map[string]Quota{}, reserved: map[string]sendpolicy.Usage{},
		seen: map[string]time.Time{}, evicted: map[string]int64{}, skipped: map[string]int64{}, shown: map[string]bool{}}, nil
}

// Load reads every quota from the table.
func (e *Enforcer) Load(ctx context.Context) error {
	list, err := e.opts.Table.List(ctx)
	if err != nil {
		return err
	}
	qs := make(map[string]Quota, len(list))
	for _, q := range list {
		qs[q.Tenant] = q
	}
	e.mu.Lock()
	e.quotas = qs
	e.mu.Unlock()
	return nil
}

// Run reads the table and updates the usage series every Refresh until
// ctx ends; a failed read is logged and tried again at the next tick.
func (e *Enforcer) Run(ctx context.Context) error {
	t := time.NewTicker(e.opts.Refresh)
	defer t.Stop()
	for {
		if err := e.Load(ctx); err != nil && ctx.Err() == nil {
			e.opts.Logger.Warn("tenant quotas not read; the last ones read stay in force", "err", err)
		}
		e.showUsage(ctx)
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

// Set writes q and puts it in force on this replica at once (the others
// within Refresh).
func (e *Enforcer) Set(ctx context.Context, q Quota) (Quota, error) {
	q, err := e.opts.Table.Set(ctx, q)
	if err != nil {
		return Quota{}, err
	}
	e.mu.Lock()
	e.quotas[q.Tenant] = q
	e.mu.Unlock()
	e.opts.Metrics.showQuota(q)
	return q, nil
}

// Delete removes tenant's quota, on this replica at once.
func (e *Enforcer) Delete(ctx context.Context, tenant string) error {
	if err := e.opts.Table.Delete(ctx, tenant); err != nil {
		return err
	}
	e.mu.Lock()
	delete(e.quotas, tenant)
	e.mu.Unlock()
	e.opts.Metrics.dropQuota(tenant)
	return nil
}

// List returns every quota in the table with its tenant's usage.
func (e *Enforcer) List(ctx context.Context) (adminapi.Quotas, error) {
	list, err := e.opts.Table.List(ctx)
	if err != nil {
		return adminapi.Quotas{}, err
	}
	out := adminapi.Quotas{Items: make([]adminapi.QuotaStatus, 0, len(list))}
	for _, q := range list {
		st, err := e.status(ctx, q)
		if err != nil {
			return adminapi.Quotas{}, err
		}
		out.Items = append(out.Items, st)
	}
	return out, nil
}

// Status returns tenant's quota with its usage, or ErrNotFound.
func (e *Enforcer) Status(ctx context.Context, tenant string) (adminapi.QuotaStatus, error) {
	list, err := e.opts.Table.List(ctx)
	if err != nil {
		return adminapi.QuotaStatus{}, err
	}
	i := slices.IndexFunc(list, func(q Quota) bool { return q.Tenant == tenant })
	if i < 0 {
		return adminapi.QuotaStatus{}, fmt.Errorf("%w: %q", ErrNotFound, tenant)
	}
	return e.status(ctx, list[i])
}

func (e *Enforcer) status(ctx context.Context, q Quota) (adminapi.QuotaStatus, error) {
	u, err := e.usage(ctx, e.opts.Spaces(q.Tenant))
	if err != nil {
		return adminapi.QuotaStatus{}, err
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	return adminapi.QuotaStatus{TenantQuota: q, UsageBytes: u.Bytes, UsageKeys: u.Keys,
		EvictedBlocks: e.evicted[q.Tenant], SkippedBlocks: e.skipped[q.Tenant]}, nil
}

// usage is what the namespaces hold: their store-time indexes' sizes
// times their values' size.
func (e *Enforcer) usage(ctx context.Context, spaces []Space) (sendpolicy.Usage, error) {
	names := make([]string, len(spaces))
	for i, s := range spaces {
		names[i] = s.Namespace
	}
	counts, err := e.opts.Store.CountStored(ctx, names)
	if err != nil {
		return sendpolicy.Usage{}, fmt.Errorf("quotas: usage: %w", err)
	}
	var u sendpolicy.Usage
	for i, n := range counts {
		u = u.Add(sendpolicy.Usage{Bytes: n * spaces[i].ValueBytes, Keys: n})
	}
	return u, nil
}

// Note records a save of tenant (a tenant without a quota keeps its
// usage series while it saves) and reports whether tenant has a quota.
func (e *Enforcer) Note(tenant string) (limited bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if tenant != "" {
		e.see(tenant)
	}
	_, limited = e.quotas[tenant]
	return limited
}

// Admit decides how many of keys, new keys of one save of tenant in
// order, may be put: all when the tenant has no quota or they fit. When
// they do not fit, a quota that evicts first removes the tenant's least
// recently used blocks to make room; what still does not fit (or, with
// on_full skip, what does not fit at once) is left out, and the caller
// skips it with reason quota. A usage that cannot be read admits none:
// another tenant's room is never taken on trust. The admitted keys stay
// reserved until release is called, once their puts are answered.
func (e *Enforcer) Admit(ctx context.Context, tenant string, keys []string) (admitted int, release func()) {
	nothing := func() {}
	e.mu.Lock()
	q, ok := e.quotas[tenant]
	e.mu.Unlock()
	if !ok || len(keys) == 0 {
		return len(keys), nothing
	}
	lock, _ := e.admitting.LoadOrStore(tenant, new(sync.Mutex))
	lock.(*sync.Mutex).Lock()
	defer lock.(*sync.Mutex).Unlock()
	spaces := e.opts.Spaces(tenant)
	sizes := valueSizes(spaces, keys)
	n, err := e.admit(ctx, q, spaces, sizes)
	if err != nil {
		e.opts.Logger.WarnContext(ctx, "tenant quota not checked; the save's new blocks are skipped", "tenant", tenant, "keys", len(keys), "err", err)
	}
	if skipped := len(keys) - n; skipped > 0 {
		e.mu.Lock()
		e.skipped[tenant] += int64(skipped)
		e.mu.Unlock()
		e.opts.Metrics.skipped.WithLabelValues(tenant).Add(float64(skipped))
	}
	return n, e.reserve(tenant, sizes[:n])
}

// admit is Admit for a tenant with quota q: the usage, room made when
// the quota evicts, and how many sizes fit then.
func (e *Enforcer) admit(ctx context.Context, q Quota, spaces []Space, sizes []int64) (int, error) {
	limit := sendpolicy.QuotaLimit{MaxBytes: q.MaxBytes, MaxKeys: q.MaxKeys}
	u, err := e.usage(ctx, spaces)
	if err != nil {
		return 0, err
	}
	e.opts.Metrics.show(q.Tenant, u, q) // what the store holds now, before the refresh
	e.mu.Lock()
	u = u.Add(e.reserved[q.Tenant])
	e.mu.Unlock()
	var add sendpolicy.Usage
	for _, s := range sizes {
		add = add.Add(sendpolicy.Usage{Bytes: s, Keys: 1})
	}
	over := limit.Over(u, add)
	if over.Zero() || q.OnFull == adminapi.QuotaSkip {
		return limit.Fit(u, sizes), nil
	}
	freed, err := e.evict(ctx, q.Tenant, spaces, over)
	if err != nil {
		e.opts.Logger.WarnContext(ctx, "tenant quota: room not made", "tenant", q.Tenant, "err", err)
	}
	return limit.Fit(u.Sub(freed), sizes), nil
}

// evict removes tenant's least recently used blocks to free need: it
// looks at the blocks stored first, removes the idlest of them, and
// forgets the index entries of blocks already gone (they free their room
// too). It returns what it freed.
func (e *Enforcer) evict(ctx context.Context, tenant string, spaces []Space, need sendpolicy.Usage) (sendpolicy.Usage, error) {
	names := make([]string, len(spaces))
	size := make(map[string]int64, len(spaces))
	var smallest int64
	for i, s := range spaces {
		names[i], size[s.Namespace] = s.Namespace, s.ValueBytes
		if smallest == 0 || s.ValueBytes < smallest {
			smallest = s.ValueBytes
		}
	}
	keys := need.Keys
	if smallest > 0 {
		keys = max(keys, (need.Bytes+smallest-1)/smallest)
	}
	n := int(min(maxCandidates, max(minCandidates, candidatesPerKey*keys)))
	oldest, err := e.opts.Store.OldestStored(ctx, names, n)
	if err != nil {
		return sendpolicy.Usage{}, err
	}
	cands, gone, freed, err := e.candidates(ctx, oldest, size)
	if err != nil {
		return sendpolicy.Usage{}, err
	}
	e.forget(ctx, gone)
	victims, _ := sendpolicy.Victims(cands, need.Sub(freed))
	if len(victims) == 0 {
		return freed, nil
	}
	out := make([]kvstore.StoredKey, len(victims))
	for i, v := range victims {
		out[i] = kvstore.StoredKey{Key: v.Key, StoredAt: v.StoredAt}
	}
	removed, err := e.opts.Store.RemoveForQuota(ctx, out, e.opts.Now())
	// Only what was removed is freed (a victim another replica removed
	// first frees nothing here); not knowing which, count the smallest.
	slices.SortFunc(victims, func(a, b sendpolicy.QuotaCandidate) int { return cmp.Compare(a.Bytes, b.Bytes) })
	for _, v := range victims[:min(removed, len(victims))] {
		freed = freed.Add(sendpolicy.Usage{Bytes: v.Bytes, Keys: 1})
	}
	if removed > 0 {
		e.mu.Lock()
		e.evicted[tenant] += int64(removed)
		e.mu.Unlock()
		e.opts.Metrics.evicted.WithLabelValues(tenant).Add(float64(removed))
	}
	if err != nil {
		return sendpolicy.Usage{}, err
	}
	return freed, nil
}

// candidates pairs the stored keys with their idle times (all 0 when the
// store keeps none); the keys already gone are returned apart, with the
// room their index entries took.
func (e *Enforcer) candidates(ctx context.Context, oldest []kvstore.StoredKey, size map[string]int64) (
	cands []sendpolicy.QuotaCandidate, gone []string, freed sendpolicy.Usage, err error,
) {
	keys := make([]string, len(oldest))
	for i, o := range oldest {
		keys[i] = o.Key
	}
	idle, err := e.opts.Store.IdleTimes(ctx, keys)
	if errors.Is(err, kvstore.ErrIdleUntracked) {
		idle, err = make([]time.Duration, len(keys)), nil
	}
	if err != nil {
		return nil, nil, sendpolicy.Usage{}, err
	}
	for i, o := range oldest {
		ns, _, _ := kvcore.SplitKey(o.Key)
		if idle[i] < 0 {
			gone = append(gone, o.Key)
			freed = freed.Add(sendpolicy.Usage{Bytes: size[ns], Keys: 1})
			continue
		}
		cands = append(cands, sendpolicy.QuotaCandidate{Key: o.Key, Bytes: size[ns], StoredAt: o.StoredAt, Idle: idle[i]})
	}
	return cands, gone, freed, nil
}

// forget takes the index entries of keys already gone out of their
// indexes (their removal went unobserved).
func (e *Enforcer) forget(ctx context.Context, gone []string) {
	if len(gone) == 0 || e.opts.StoreTimes == nil {
		return
	}
	if _, err := e.opts.StoreTimes.TakeStored(ctx, gone); err != nil {
		e.opts.Logger.WarnContext(ctx, "tenant quota: entries of removed blocks not forgotten", "keys", len(gone), "err", err)
	}
}

// reserve holds sizes against tenant until the returned release.
func (e *Enforcer) reserve(tenant string, sizes []int64) func() {
	var u sendpolicy.Usage
	for _, s := range sizes {
		u = u.Add(sendpolicy.Usage{Bytes: s, Keys: 1})
	}
	if u.Zero() {
		return func() {}
	}
	e.mu.Lock()
	e.reserved[tenant] = e.reserved[tenant].Add(u)
	e.mu.Unlock()
	var once sync.Once
	return func() {
		once.Do(func() {
			e.mu.Lock()
			defer e.mu.Unlock()
			if r := e.reserved[tenant].Sub(u); r.Zero() {
				delete(e.reserved, tenant)
			} else {
				e.reserved[tenant] = r
			}
		})
	}
}

// see records a save of tenant, so its usage is shown (under e.mu).
func (e *Enforcer) see(tenant string) {
	if _, ok := e.seen[tenant]; !ok && len(e.seen) >= maxSeen {
		return
	}
	e.seen[tenant] = e.opts.Now()
}

// showUsage sets the usage and quota series of every tenant with a quota
// or a save in the last hour, and drops the others'.
func (e *Enforcer) showUsage(ctx context.Context) {
	now := e.opts.Now()
	e.mu.Lock()
	quotas := maps.Clone(e.quotas)
	tenants := slices.Collect(maps.Keys(quotas))
	for t, at := range e.seen {
		if now.Sub(at) > seenFor {
			delete(e.seen, t)
			continue
		}
		if _, ok := quotas[t]; !ok {
			tenants = append(tenants, t)
		}
	}
	e.mu.Unlock()
	slices.Sort(tenants)
	shown := map[string]bool{}
	for _, t := range tenants {
		u, err := e.usage(ctx, e.opts.Spaces(t))
		if err != nil {
			if ctx.Err() == nil {
				e.opts.Logger.Warn("tenant usage not read", "tenant", t, "err", err)
			}
			continue
		}
		shown[t] = true
		e.opts.Metrics.show(t, u, quotas[t])
	}
	for t := range e.shown {
		if !shown[t] {
			e.opts.Metrics.drop(t)
		}
	}
	e.shown = shown
}

// valueSizes is the value size of each key, by its namespace.
func valueSizes(spaces []Space, keys []string) []int64 {
	size := make(map[string]int64, len(spaces))
	for _, s := range spaces {
		size[s.Namespace] = s.ValueBytes
	}
	out := make([]int64, len(keys))
	for i, k := range keys {
		ns, _, _ := kvcore.SplitKey(k)
		out[i] = size[ns]
	}
	return out
}
