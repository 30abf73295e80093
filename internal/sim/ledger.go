package sim

import (
	"cmp"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"

	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// ledger accounts for every save of the run: the save tasks the scheduler
// published (kvmesh.save.tasks), the sender's result for each
// (kvmesh.transfer.results), and the saves the engines expected from their
// own steps (a shadow requeststate.Tracker per request). Safe for concurrent use.
type ledger struct {
	mu                         sync.Mutex
	model                      *kvcore.Model
	prefix                     string // request-id prefix of the run
	tasks                      map[string]*ledgerTask
	results                    map[string]contract.TransferResult // save results by task id
	loads                      map[string]contract.TransferResult // load results by task id
	expect                     map[string][]span                  // engine/request → saves the engine expects
	stored                     map[string]string                  // keys the run's BlockStored events named → the first engine that stored it
	removed                    map[string]bool                    // keys BlockRemoved events named (the store dropped them)
	announced, storedByResults int                                // keys in those events; keys the results report stored
	hashIndex                  map[string]int                     // block hash (hex) → its index in the hash chain, from the tasks
	namespaces                 [][]kvcore.Rank                    // each group's store namespaces

	dupTasks, dupResults, undecodable int
	badTables                         []string
	onSaved                           func(engine, request string, rep savedReport)
	raced                             map[string]bool // engine/request preempted with saves in flight, or with a save reported unsaved
	putFailuresAccounted              bool            // Config.WorkerRestarts: put_failed keys are accounted, and must be dead-lettered

	// tenants maps each run request to its tenant (nil: no request has
	// one); wrongTenant lists the save tasks and stored keys that are not
	// of their request's tenant, and the stored keys not of the run's model.
	tenants     map[string]string
	wrongTenant []LedgerDifference

	// tokens are the prompt token ids each request's save tasks carried
	// (engine/request → the longest list); claims the BlockStored events
	// that carried token_ids, checked against them by report, and
	// tokenEvents their count.
	tokens      map[string][]uint32
	claims      []tokenClaim
	tokenEvents int
}

// span is one save's token range.
type span struct{ Start, End int }

// savedReport is what the ledger tells an engine about one of its saves
// once both the task and its result were seen.
type savedReport struct {
	taskID string
	span   span
	status kvcore.SaveStatus
	// report is what the result tells the request's tracker
	// (contract.SaveReportOf), as the scheduler's trackers read it.
	report kvcore.SaveReport
}

type ledgerTask struct {
	engine, request string
	span            span
	keys            int
	// rankKeys counts the keys each worker rank writes (Model.Writer).
	rankKeys map[kvcore.Rank]int
}

func newLedger(m *kvcore.Model, prefix string, putFailuresAccounted bool) *ledger {
	l := &ledger{
		model: m, prefix: prefix, putFailuresAccounted: putFailuresAccounted, tasks: map[string]*ledgerTask{},
		results: map[string]contract.TransferResult{}, loads: map[string]contract.TransferResult{},
		expect: map[string][]span{}, stored: map[string]string{}, removed: map[string]bool{}, raced: map[string]bool{}, hashIndex: map[string]int{},
		tokens: map[string][]uint32{},
	}
	for g := range m.Groups {
		l.namespaces = append(l.namespaces, m.Namespaces(g))
	}
	return l
}

func (l *ledger) ours(requestID string) bool { return strings.HasPrefix(requestID, l.prefix) }

// expectSave records a save the engine's own steps imply.
func (l *ledger) expectSave(engine, request string, s span) {
	l.mu.Lock()
	defer l.mu.Unlock()
	k := engine + "/" + request
	l.expect[k] = append(l.expect[k], s)
}

// saveTask records one record of kvmesh.save.tasks.
func (l *ledger) saveTask(rec Record) {
	task, err := kvcore.DecodeSaveTask(rec.Value)
	if err != nil {
		if l.ours(rec.Key) {
			l.mu.Lock()
			l.undecodable++
			l.mu.Unlock()
		}
		return
	}
	if !l.ours(task.RequestID) {
		return
	}
	if want := l.tenants[task.RequestID]; task.Tenant != want {
		l.tenantDifference(LedgerDifference{task.EngineID, task.RequestID, task.TaskID,
			fmt.Sprintf("save task of tenant %q, the request's tenant is %q", task.Tenant, want)})
	}
	lt := &ledgerTask{engine: task.EngineID, request: task.RequestID, span: span{task.Start, task.End}, keys: l.taskKeys(task), rankKeys: l.rankKeys(task)}
	l.mu.Lock()
	for i, h := range task.BlockHashes {
		l.hashIndex[h] = i
	}
	l.taskTokens(task)
	if _, dup := l.tasks[task.TaskID]; dup {
		l.dupTasks++
		l.mu.Unlock()
		return
	}
	l.tasks[task.TaskID] = lt
	if !tableCovers(l.model, task) {
		l.badTables = append(l.badTables, task.TaskID)
	}
	res, reported := l.results[task.TaskID]
	l.mu.Unlock()
	if reported {
		l.saved(task.TaskID, lt, res)
	}
}

// taskKeys is the number of store keys a task asks for: its chunks, in every
// rank namespace of their group.
func (l *ledger) taskKeys(t *kvcore.SaveTask) int {
	n := 0
	for _, gc := range t.Groups {
		ranks := 1
		if gc.Group >= 0 && gc.Group < len(l.model.Groups) {
			ranks = len(l.model.Namespaces(gc.Group))
		}
		n += len(gc.Chunks) * ranks
	}
	return n
}

// rankKeys counts the keys of a task each worker rank writes: every chunk
// in every namespace of its group goes to the rank Model.Writer names.
func (l *ledger) rankKeys(t *kvcore.SaveTask) map[kvcore.Rank]int {
	out := map[kvcore.Rank]int{}
	for _, gc := range t.Groups {
		if gc.Group < 0 || gc.Group >= len(l.model.Groups) {
			continue
		}
		bs := l.model.Groups[gc.Group].BlockSize
		for _, c := range gc.Chunks {
			for _, ns := range l.namespaces[gc.Group] {
				out[l.model.Writer(gc.Group, ns, c.Start/bs)]++
			}
		}
	}
	return out
}

// tableCovers reports whether a task's block table has one list per model
// group and every listed chunk's block inside it: the seed bug published
// saves whose table was empty.
func tableCovers(m *kvcore.Model, t *kvcore.SaveTask) bool {
	if len(t.BlockTable) != len(m.Groups) {
		return false
	}
	for _, gc := range t.Groups {
		if gc.Group < 0 || gc.Group >= len(m.Groups) {
			return false
		}
		for _, c := range gc.Chunks {
			if c.BlockIndex(m.Groups[gc.Group].BlockSize) >= len(t.BlockTable[gc.Group]) {
				return false
			}
		}
	}
	return true
}

// transferResult records one record of kvmesh.transfer.results.
func (l *ledger) transferResult(rec Record) {
	var r contract.TransferResult
	if err := json.Unmarshal(rec.Value, &r); err != nil || !l.ours(r.RequestID) {
		return
	}
	l.mu.Lock()
	if r.Kind == contract.TransferLoad {
		id := cmp.Or(r.ResultID, r.TaskID) // a multi-rank load has one result per rank
		if _, dup := l.loads[id]; !dup {
			l.loads[id] = r
		}
		l.mu.Unlock()
		return
	}
	if _, dup := l.results[r.TaskID]; dup {
		l.dupResults++
		l.mu.Unlock()
		return
	}
	l.results[r.TaskID] = r
	for _, g := range r.Groups {
		l.storedByResults += g.Stored
	}
	lt := l.tasks[r.TaskID]
	l.mu.Unlock()
	if lt != nil {
		l.saved(r.TaskID, lt, r)
	}
}

// kvEvent records one record of kvmesh.kv.events: the store keys a
// BlockStored record of a run request names (contract.DecodeKVEventRecord:
// the vLLM batch in the value, the namespace, full hashes and request in
// the headers). BlockRemoved and AllBlocksCleared records, and records of
// other runs, leave the ledger alone.
func (l *ledger) kvEvent(rec Record) {
	ev, err := contract.DecodeKVEventRecord(rec.Value, rec.Headers)
	if err == nil && ev.Kind() == contract.BlockRemoved {
		l.removedKeys(ev.Keys())
		return
	}
	if err != nil || ev.Kind() != contract.BlockStored || !l.ours(ev.RequestID) {
		return
	}
	keys := ev.Keys()
	want := l.tenants[ev.RequestID]
	fp := l.model.Fingerprint()
	for _, k := range keys {
		p, err := kvcore.ParseKey(k)
		switch {
		case err != nil:
		case p.Tenant != want:
			l.tenantDifference(LedgerDifference{ev.EngineID, ev.RequestID, "",
				fmt.Sprintf("stored key %s is of tenant %q, the request's tenant is %q", k, p.Tenant, want)})
		case p.Model != l.model.Name || p.Fingerprint != fp:
			l.tenantDifference(LedgerDifference{ev.EngineID, ev.RequestID, "",
				fmt.Sprintf("stored key %s is of model %s (fingerprint %s), the run's model is %s (%s)", k, p.Model, p.Fingerprint, l.model.Name, fp)})
		}
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.announced += len(keys)
	l.eventTokens(ev)
	for _, k := range keys {
		if _, seen := l.stored[k]; !seen {
			l.stored[k] = ev.EngineID
		}
	}
}

// tenantDifference records a save task or stored key of another tenant
// than its request's, or a stored key of another model than the run's
// (the first maxListed of them are listed).
func (l *ledger) tenantDifference(d LedgerDifference) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.wrongTenant) < maxListed {
		l.wrongTenant = append(l.wrongTenant, d)
	}
}

// storedByTenant counts the distinct stored keys of each tenant (the
// tenant segment of the key; "" for none).
func (l *ledger) storedByTenant() map[string]int {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := map[string]int{}
	for k := range l.stored {
		if p, err := kvcore.ParseKey(k); err == nil {
			out[p.Tenant]++
		}
	}
	return out
}

// removedKeys records keys a BlockRemoved event named. Removals carry no
// request, so every one is kept; the stored-value check asks only about the
// run's own keys.
func (l *ledger) removedKeys(keys []string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, k := range keys {
		l.removed[k] = true
	}
}

// wasRemoved reports whether a BlockRemoved event named key.
func (l *ledger) wasRemoved(key string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.removed[key]
}

// storedKeys lists, sorted, the distinct keys the run's BlockStored events
// named, and how many keys the events named in all.
func (l *ledger) storedKeys() (keys []string, announced int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Sorted(maps.Keys(l.stored)), l.announced
}

// unannounced is the number of keys the save results report stored beyond
// those the BlockStored events named so far.
func (l *ledger) unannounced() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return max(0, l.storedByResults-l.announced)
}

func (l *ledger) saved(id string, lt *ledgerTask, res contract.TransferResult) {
	status := kvcore.SaveStatus(res.Status)
	rep := contract.SaveReportOf(status, res.Groups)
	if rep.Skipped+rep.Failed+rep.ExistsFailed > 0 || status == kvcore.SaveSkipped || status == kvcore.SaveFailed {
		// The range is saved again, by a re-save or by the request's next
		// save, depending on what else of the request the scheduler and
		// the engine's shadow had seen when the result reached each: the
		// request's saves are compared by the tokens they cover.
		l.mu.Lock()
		l.raced[lt.engine+"/"+lt.request] = true
		l.mu.Unlock()
	}
	if l.onSaved != nil {
		l.onSaved(lt.engine, lt.request, savedReport{taskID: id, span: lt.span, status: status, report: rep})
	}
}

// preemptedInFlight records that a request was preempted with saves in
// flight. The scheduler's tracker and the engine's shadow may see that
// save's report on different sides of the preemption: the request's saves
// are compared by the tokens they cover, not span by span.
func (l *ledger) preemptedInFlight(engine, request string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.raced[engine+"/"+request] = true
}

// deadLettered lists engine/request of the run's saves whose results report
// dead-lettered keys, or keys failed for put_failed that the ledger
// accounts (Config.WorkerRestarts): the sender dead-letters those too.
func (l *ledger) deadLettered() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	seen := map[string]bool{}
	var out []string
	for id, res := range l.results {
		t := l.tasks[id]
		if t == nil {
			continue
		}
		for _, g := range res.Groups {
			if k := t.engine + "/" + t.request; (g.DeadLettered > 0 || l.accountedFailure(g)) && !seen[k] {
				seen[k] = true
				out = append(out, k)
			}
		}
	}
	return out
}

// outstanding counts what the ledger still waits for: published saves
// without a result and expected saves not published.
func (l *ledger) outstanding() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for id := range l.tasks {
		if _, ok := l.results[id]; !ok {
			n++
		}
	}
	published := l.publishedSpans()
	for k, spans := range l.expect {
		got := countSpans(published[k])
		for s, want := range countSpans(spans) {
			n += max(0, want-got[s])
		}
	}
	return n
}

func (l *ledger) publishedSpans() map[string][]span {
	out := map[string][]span{}
	for _, t := range l.tasks {
		k := t.engine + "/" + t.request
		out[k] = append(out[k], t.span)
	}
	return out
}

// LedgerReport is the save ledger of a run, in store keys (chunks × rank
// namespaces): every key the published save tasks asked for must be
// accounted for by the sender as stored, already existing, skipped (store
// pressure) or dead-lettered; and every save the engines' own steps imply
// must have been published.
type LedgerReport struct {
	LedgerCounts
	// Statuses counts the results by task status.
	Statuses map[string]int `json:"statuses"`
	// CoverageCompared counts requests preempted with saves in flight,
	// whose published saves are compared with the engine's by the tokens
	// they cover rather than span by span (the engine's tracker and the
	// scheduler's may see those saves' reports on different sides of the
	// preemption).
	CoverageCompared int `json:"coverage_compared"`
	// DuplicateTasks and DuplicateResults count redelivered records (harmless).
	DuplicateTasks   int `json:"duplicate_tasks"`
	DuplicateResults int `json:"duplicate_results"`
	// MalformedTables lists run save tasks whose block table has the wrong
	// group count or is shorter than its chunks (the seed bug).
	MalformedTables []string `json:"malformed_tables"`
	// Undecodable counts run records on kvmesh.save.tasks that did not decode.
	Undecodable int `json:"undecodable"`
	// TokenEvents counts the run's BlockStored events that carried
	// token_ids; each was checked to be exactly its blocks' prompt tokens
	// (a mismatch is a difference).
	TokenEvents int `json:"token_events"`
	// Balanced is set when every expected key is accounted for as stored,
	// existing, skipped or dead-lettered, every task has its result, and the
	// published saves are exactly the engines' expected saves.
	Balanced bool `json:"balanced"`
	// Differences lists every imbalance by request.
	Differences []LedgerDifference `json:"differences"`
	// SaveBytes and LoadBytes sum the bytes the results report.
	SaveBytes int64 `json:"save_bytes"`
	LoadBytes int64 `json:"load_bytes"`
	// LoadTasks counts the load tasks reported, LoadResults their results
	// (one per rank of a multi-rank engine), LoadErrorBlocks the load
	// errors of those results, LoadTierBlocks the blocks they read from
	// the capacity tier rather than Redis.
	LoadTasks       int `json:"load_tasks"`
	LoadResults     int `json:"load_results"`
	LoadErrorBlocks int `json:"load_error_blocks"`
	LoadTierBlocks  int `json:"load_tier_blocks"`
	// Engines splits the ledger by engine, in engine id order: the run's
	// ledger balances when every engine's does and no run-wide difference
	// is left.
	Engines []EngineLedger `json:"engines"`
	// Ranks splits the expected and stored keys by the worker rank that
	// writes them, engine by engine in engine id order, ranks in
	// Model.WorkerRanks order: a stored key is attributed through its
	// namespace and chunk (kvcore.Model.Writer) to the one rank that writes
	// it, and no rank may have stored more keys than it was asked to write.
	Ranks []RankLedger `json:"ranks"`
	// RanksUnattributed counts stored keys no rank writes: a namespace that
	// is not one of its group's, or a hash no save task of the run named.
	RanksUnattributed int `json:"ranks_unattributed"`
	// RanksBalanced is set when every stored key is attributed to a rank
	// and no rank stored more than it was asked to write.
	RanksBalanced bool `json:"ranks_balanced"`
}

// RankLedger is the save ledger of one worker rank of one engine, in store
// keys.
type RankLedger struct {
	// EngineID is the engine.
	EngineID string `json:"engine_id"`
	// Rank is the worker rank; Name its label (tp3-pcp0-dcp0-pp0).
	Rank kvcore.Rank `json:"rank"`
	Name string      `json:"name"`
	// ExpectedKeys counts the keys the engine's save tasks ask this rank to
	// write (every chunk in every namespace of its group, Model.Writer).
	ExpectedKeys int `json:"expected_keys"`
	// StoredKeys counts the distinct keys the engine's BlockStored events
	// named that this rank writes.
	StoredKeys int `json:"stored_keys"`
	// Balanced is set when StoredKeys does not exceed ExpectedKeys (the
	// rest existed, were skipped or were dead-lettered).
	Balanced bool `json:"balanced"`
}

// LedgerCounts are the save ledger's counts, in store keys: of the run
// (LedgerReport) or of one engine (EngineLedger).
type LedgerCounts struct {
	// SaveTasks counts the distinct save tasks published.
	SaveTasks int `json:"save_tasks"`
	// Reported counts those with a result.
	Reported int `json:"reported"`
	// ExpectedChunks is the number of keys the tasks asked for.
	ExpectedChunks int `json:"expected_chunks"`
	// Stored, Existing, Skipped, DeadLettered and Failed are the sender's
	// per-key outcomes summed over the results.
	Stored       int `json:"stored"`
	Existing     int `json:"existing"`
	Skipped      int `json:"skipped"`
	DeadLettered int `json:"dead_lettered"`
	Failed       int `json:"failed"`
	// EngineExpectedSaves counts the saves the engines' steps imply.
	EngineExpectedSaves int `json:"engine_expected_saves"`
}

// addGroups sums one result's per-key outcomes.
func (c *LedgerCounts) addGroups(groups []contract.GroupOutcome) {
	for _, g := range groups {
		c.Stored += g.Stored
		c.Existing += g.Existing
		c.Skipped += g.Skipped
		c.DeadLettered += g.DeadLettered
		c.Failed += g.Failed
	}
}

// EngineLedger is the save ledger of one engine's requests, in store keys.
type EngineLedger struct {
	// EngineID is the engine.
	EngineID string `json:"engine_id"`
	// LedgerCounts are the counts of the engine's save tasks.
	LedgerCounts
	// Differences counts the ledger differences of the engine's requests.
	Differences int `json:"differences"`
	// Balanced is set when the engine's requests show no difference.
	Balanced bool `json:"balanced"`
}

// LedgerDifference is one imbalance of the save ledger.
type LedgerDifference struct {
	// EngineID and RequestID name the request (empty for a run-wide problem).
	EngineID  string `json:"engine_id"`
	RequestID string `json:"request_id"`
	// TaskID is the save task concerned, when there is one.
	TaskID string `json:"task_id,omitempty"`
	// Problem says what does not add up.
	Problem string `json:"problem"`
}

// report builds the ledger report.
func (l *ledger) report() LedgerReport {
	l.mu.Lock()
	defer l.mu.Unlock()
	r := LedgerReport{
		LedgerCounts: LedgerCounts{SaveTasks: len(l.tasks)}, Statuses: map[string]int{}, DuplicateTasks: l.dupTasks,
		DuplicateResults: l.dupResults, MalformedTables: slices.Clone(l.badTables), Undecodable: l.undecodable,
	}
	for id, t := range l.tasks {
		r.ExpectedChunks += t.keys
		res, ok := l.results[id]
		if !ok {
			r.Differences = append(r.Differences, LedgerDifference{t.engine, t.request, id, "no result reported"})
			continue
		}
		r.Reported++
		r.add(t, id, res, l.accountedFailure)
	}
	loadTasks := map[string]bool{}
	for _, res := range l.loads {
		loadTasks[res.TaskID] = true
		r.LoadResults++
		r.LoadBytes += res.Bytes
		r.LoadErrorBlocks += len(res.LoadErrors)
		r.LoadTierBlocks += res.TierBlocks
	}
	r.LoadTasks = len(loadTasks)
	r.Differences = append(r.Differences, l.spanDifferences(&r)...)
	r.Differences = append(r.Differences, l.rankLedgers(&r)...)
	for _, id := range l.badTables {
		t := l.tasks[id]
		r.Differences = append(r.Differences, LedgerDifference{t.engine, t.request, id, "block table does not cover the model's groups"})
	}
	if l.undecodable > 0 {
		r.Differences = append(r.Differences, LedgerDifference{Problem: fmt.Sprintf("%d undecodable save records keyed by run requests", l.undecodable)})
	}
	r.Differences = append(r.Differences, l.wrongTenant...)
	r.Differences = append(r.Differences, l.tokenDifferences()...)
	r.TokenEvents = l.tokenEvents
	slices.SortFunc(r.Differences, func(a, b LedgerDifference) int {
		return cmp.Or(cmp.Compare(a.RequestID, b.RequestID), cmp.Compare(a.EngineID, b.EngineID), cmp.Compare(a.TaskID, b.TaskID))
	})
	r.Balanced = len(r.Differences) == 0
	r.Engines = l.engineLedgers(r.Differences)
	return r
}

// rankLedgers splits the expected and stored keys by writing rank and
// returns the imbalances; l.mu must be held.
func (l *ledger) rankLedgers(r *LedgerReport) []LedgerDifference {
	type er struct {
		engine string
		rank   kvcore.Rank
	}
	expected, stored := map[er]int{}, map[er]int{}
	engines := map[string]bool{}
	for _, t := range l.tasks {
		engines[t.engine] = true
		for rk, n := range t.rankKeys {
			expected[er{t.engine, rk}] += n
		}
	}
	unattributed := map[string]int{}
	for key, engine := range l.stored {
		w, ok := l.writer(key)
		if !ok {
			unattributed[engine]++
			continue
		}
		engines[engine] = true
		stored[er{engine, w}]++
	}
	var diffs []LedgerDifference
	for _, e := range slices.Sorted(maps.Keys(engines)) {
		for _, rk := range l.model.WorkerRanks() {
			k := er{e, rk}
			rl := RankLedger{EngineID: e, Rank: rk, Name: rk.String(), ExpectedKeys: expected[k], StoredKeys: stored[k]}
			rl.Balanced = rl.StoredKeys <= rl.ExpectedKeys
			if !rl.Balanced {
				diffs = append(diffs, LedgerDifference{EngineID: e, Problem: fmt.Sprintf("rank %s stored %d keys, its save tasks asked it to write %d", rl.Name, rl.StoredKeys, rl.ExpectedKeys)})
			}
			r.Ranks = append(r.Ranks, rl)
		}
		if n := unattributed[e]; n > 0 {
			r.RanksUnattributed += n
			diffs = append(diffs, LedgerDifference{EngineID: e, Problem: fmt.Sprintf("%d stored keys are written by no rank (a namespace not of their group, or a hash no save task named)", n)})
		}
	}
	r.RanksBalanced = len(diffs) == 0
	return diffs
}

// writer is the worker rank that writes a stored key: the key's namespace
// and the chunk its hash ends (from the hash chains of the tasks); false
// when the key is not one the run's tasks could have asked for. l.mu must
// be held.
func (l *ledger) writer(key string) (kvcore.Rank, bool) {
	p, err := kvcore.ParseKey(key)
	if err != nil || p.Group < 0 || p.Group >= len(l.model.Groups) || !slices.Contains(l.namespaces[p.Group], p.Rank) {
		return kvcore.Rank{}, false
	}
	hi, ok := l.hashIndex[p.Hash.Hex()]
	if !ok {
		return kvcore.Rank{}, false
	}
	bs := l.model.Groups[p.Group].BlockSize
	end := (hi + 1) * l.model.HashBlockSize
	if end%bs != 0 && !l.model.PartialHashHits() {
		return kvcore.Rank{}, false // a hash that ends no chunk of the group
	}
	// Under partial hash hits a chunk may end inside its block (a prompt
	// tail): its block is the one holding its last token.
	return l.model.Writer(p.Group, p.Rank, (end-1)/bs), true
}

// engineLedgers splits the ledger by engine; l.mu must be held.
func (l *ledger) engineLedgers(diffs []LedgerDifference) []EngineLedger {
	per := map[string]*EngineLedger{}
	get := func(id string) *EngineLedger {
		if per[id] == nil {
			per[id] = &EngineLedger{EngineID: id}
		}
		return per[id]
	}
	for id, t := range l.tasks {
		e := get(t.engine)
		e.SaveTasks++
		e.ExpectedChunks += t.keys
		res, ok := l.results[id]
		if !ok {
			continue
		}
		e.Reported++
		e.addGroups(res.Groups)
	}
	for k, spans := range l.expect {
		engine, _, _ := strings.Cut(k, "/")
		get(engine).EngineExpectedSaves += len(spans)
	}
	for _, d := range diffs {
		if d.EngineID != "" {
			get(d.EngineID).Differences++
		}
	}
	out := make([]EngineLedger, 0, len(per))
	for _, id := range slices.Sorted(maps.Keys(per)) {
		e := per[id]
		e.Balanced = e.Differences == 0
		out = append(out, *e)
	}
	return out
}

// accountedFailure says whether a group's failed keys are an outcome the
// run expects rather than a difference: put_failed under WorkerRestarts.
func (l *ledger) accountedFailure(g contract.GroupOutcome) bool {
	return l.putFailuresAccounted && g.Failed > 0 && g.Reason == string(kvcore.ReasonPutFailed)
}

// add accounts one task's result; failed keys are a difference unless
// accounted says the run expects them.
func (r *LedgerReport) add(t *ledgerTask, id string, res contract.TransferResult, accounted func(contract.GroupOutcome) bool) {
	r.Statuses[res.Status]++
	r.SaveBytes += res.Bytes
	r.addGroups(res.Groups)
	got, failed := 0, 0
	for _, g := range res.Groups {
		failed += g.Failed
		got += g.Stored + g.Existing + g.Skipped + g.DeadLettered
		if g.Failed > 0 && !accounted(g) {
			r.Differences = append(r.Differences, LedgerDifference{t.engine, t.request, id,
				fmt.Sprintf("group %d: %d keys failed (%s)", g.Group, g.Failed, g.Reason)})
		}
	}
	if got+failed != t.keys {
		r.Differences = append(r.Differences, LedgerDifference{t.engine, t.request, id,
			fmt.Sprintf("task asked for %d keys, result accounts for %d", t.keys, got+failed)})
	}
}

// spanDifferences compares the saves the engines expected with those
// published, per request, counting repeats: a save published twice under two
// task ids is a difference too.
func (l *ledger) spanDifferences(r *LedgerReport) []LedgerDifference {
	var out []LedgerDifference
	published := l.publishedSpans()
	keys := map[string]bool{}
	for k, spans := range l.expect {
		r.EngineExpectedSaves += len(spans)
		keys[k] = true
	}
	for k := range published {
		keys[k] = true
	}
	for k := range keys {
		engine, request, _ := strings.Cut(k, "/")
		if l.raced[k] {
			r.CoverageCompared++
			out = append(out, coverageDifferences(engine, request, l.expect[k], published[k])...)
			continue
		}
		want, got := countSpans(l.expect[k]), countSpans(published[k])
		for s, n := range want {
			if got[s] < n {
				out = append(out, LedgerDifference{EngineID: engine, RequestID: request,
					Problem: fmt.Sprintf("save of tokens [%d,%d) implied by the engine's steps was published %d time(s), expected %d", s.Start, s.End, got[s], n)})
			}
		}
		for s, n := range got {
			if n > want[s] {
				out = append(out, LedgerDifference{EngineID: engine, RequestID: request,
					Problem: fmt.Sprintf("save of tokens [%d,%d) published %d time(s), the engine's steps imply %d", s.Start, s.End, n, want[s])})
			}
		}
	}
	return out
}

// coverageDifferences compares the tokens the engine's saves and the
// published saves of one request cover: each must cover the other.
func coverageDifferences(engine, request string, expected, published []span) []LedgerDifference {
	var out []LedgerDifference
	want, got := union(expected), union(published)
	for _, s := range uncovered(want, got) {
		out = append(out, LedgerDifference{EngineID: engine, RequestID: request,
			Problem: fmt.Sprintf("tokens [%d,%d) the engine's steps imply saved are in no published save", s.Start, s.End)})
	}
	for _, s := range uncovered(got, want) {
		out = append(out, LedgerDifference{EngineID: engine, RequestID: request,
			Problem: fmt.Sprintf("published saves cover tokens [%d,%d), which the engine's steps imply no save of", s.Start, s.End)})
	}
	return out
}

// union merges spans into sorted, disjoint spans.
func union(spans []span) []span {
	s := slices.Clone(spans)
	slices.SortFunc(s, func(a, b span) int { return cmp.Or(cmp.Compare(a.Start, b.Start), cmp.Compare(a.End, b.End)) })
	var out []span
	for _, x := range s {
		if x.End <= x.Start {
			continue
		}
		if n := len(out); n > 0 && x.Start <= out[n-1].End {
			out[n-1].End = max(out[n-1].End, x.End)
			continue
		}
		out = append(out, x)
	}
	return out
}

// uncovered lists the parts of the disjoint sorted spans a that the
// disjoint sorted spans b do not cover.
func uncovered(a, b []span) []span {
	var out []span
	for _, x := range a {
		at := x.Start
		for _, y := range b {
			if y.End <= at || y.Start >= x.End {
				continue
			}
			if y.Start > at {
				out = append(out, span{at, y.Start})
			}
			at = max(at, y.End)
		}
		if at < x.End {
			out = append(out, span{at, x.End})
		}
	}
	return out
}

func countSpans(spans []span) map[span]int {
	out := map[span]int{}
	for _, s := range spans {
		out[s]++
	}
	return out
}
