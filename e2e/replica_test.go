package e2e

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kvmesh/kvmesh/internal/sim"
	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// Consumer groups of the replicated services and what they consume.
const (
	schedulerGroup = "kvmesh-scheduler"
	senderGroup    = "kvmesh-sender"
	// schedulerConsumers is the replica test's KVMESH_SCHEDULER_CONSUMERS:
	// group members per scheduler process (a sender process has one).
	schedulerConsumers = 4
)

var groupTopics = map[string][]string{
	schedulerGroup: {contract.TopicEngineSteps, contract.TopicLookupDecisions, contract.TopicTransferResults},
	senderGroup:    {contract.TopicSaveTasks},
}

// workCounters is, per replicated service, the counter family that grows
// with the work a process does: the busier replica is the one killed.
var workCounters = map[string]string{
	"scheduler": "kvmesh_scheduler_records_total",
	"sender":    "kvmesh_sender_tasks_total",
	"lookup":    "kvmesh_lookup_requests_total",
}

// redeliveryCounters count, per service, the records a process recognised
// as already applied and ignored.
var redeliveryCounters = map[string]string{
	"scheduler": "kvmesh_scheduler_duplicates_total",
	"sender":    "kvmesh_sender_duplicate_tasks_total",
}

// TestReplicaKillsMidRun runs two replicas each of the scheduler, the
// sender and the lookup against one database and one broker (the
// schedulers' and the senders' consumer groups share the partitions), plus
// the 1P1D gpuworkers, and SIGKILLs the busier replica of each service in
// turn mid-run, never restarting it. The run must complete clean
// (requireOK); the database must hold no duplicated effect (no task or
// finished_sending emitted twice, one save outcome per save task and one
// applied result per task); and the survivors must own every partition and
// have consumed every record (lag 0).
func TestReplicaKillsMidRun(t *testing.T) {
	s := newStack(t, stackOptions{model: model, connectors: "pd,store", poolBlocks: 64, replicas: 2,
		env: []string{"KVMESH_SCHEDULER_CONSUMERS=" + strconv.Itoa(schedulerConsumers)}})
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	groups := newGroupReader(t, s.brokers)
	// Every replica joined its group before the run: the partitions are
	// shared.
	groups.waitMembers(ctx, schedulerGroup, 2*schedulerConsumers)
	groups.waitMembers(ctx, senderGroup, 2)

	cfg := simConfig(t, s, true, smallWorkload(48, 3))
	began := time.Now()
	progress, done := startRun(ctx, cfg)
	kills := []struct {
		service string
		at      int // requests done
	}{{"sender", 10}, {"scheduler", 22}, {"lookup", 34}}
	type killed struct {
		victim, survivor string
		survived         float64       // the survivor's work counter at the kill
		first, stall     time.Duration // to the next request done; longest wait for one
	}
	var victims []killed
	var r *runResult
	for i, k := range kills {
		p := waitDone(t, progress, done, k.at)
		victim, survivor, vw, sw := busier(t, s, k.service)
		if vw == 0 {
			t.Fatalf("the busier %s replica %s did no work (%s %v) by %d requests done: the kill would test nothing", k.service, victim, workCounters[k.service], vw, p.Done)
		}
		s.kill(victim)
		until := math.MaxInt // the last kill is watched to the run's end
		if i+1 < len(kills) {
			until = kills[i+1].at
		}
		first, stall, end := watchAfterKill(progress, done, p.Done, until)
		switch {
		case first < 0:
			t.Fatalf("the run ended (err %v) without a request done after %s was killed", end.err, victim)
		case end != nil && until != math.MaxInt:
			t.Fatalf("the run ended (err %v) before %d requests were done", end.err, until)
		}
		r = end
		victims = append(victims, killed{victim: victim, survivor: survivor, survived: sw, first: first, stall: stall})
		t.Logf("killed %s at %d requests done (%s %v, %s %v); the next request was done %v later, the longest wait for one %v",
			victim, p.Done, victim, vw, survivor, sw, first.Round(time.Millisecond), stall.Round(time.Millisecond))
	}
	if r == nil {
		t.Fatal("the run did not end after the last kill")
	}
	runTime := time.Since(began)
	if r.err != nil {
		t.Fatal(r.err)
	}
	requireOK(t, r.rep)
	checkAllSaveTables(ctx, t, s, r.rep)
	for _, k := range victims {
		if err := s.alive(k.survivor); err != nil {
			t.Fatalf("survivor %s: %v", k.survivor, err)
		}
		service, _, _ := strings.Cut(k.survivor, "-")
		if now := workCounter(t, s, k.survivor, workCounters[service]); now <= k.survived {
			t.Fatalf("survivor %s did no work after %s was killed (%s %v then and now)", k.survivor, k.victim, workCounters[service], now)
		}
	}
	dup := checkNoDuplicateEffects(ctx, t, s)
	republished := republishedRecords(ctx, t, s)
	lag := map[string]int64{}
	for g, members := range map[string]int{schedulerGroup: schedulerConsumers, senderGroup: 1} { // one process each survives
		lag[g] = groups.waitTakenOver(ctx, g, members)
	}
	var rec []string
	redelivered := map[string]float64{} // repeats the survivors recognised and ignored
	for _, k := range victims {
		rec = append(rec, fmt.Sprintf("%s %v (longest wait %v)", k.victim, k.first.Round(time.Millisecond), k.stall.Round(time.Millisecond)))
		if family := redeliveryCounters[strings.SplitN(k.survivor, "-", 2)[0]]; family != "" {
			redelivered[k.survivor] = workCounter(t, s, k.survivor, family)
		}
	}
	t.Logf("FIGURES: %d requests (%d ok) in %v; next request done after each kill: %s; duplicates found: %d (%s); lag at end: %v; save tasks %d, load tasks %d; redeliveries ignored as repeats %v; records published again by an outbox relay (at least once, absorbed by their consumers) %v",
		r.rep.Requests.Total, r.rep.Requests.OK, runTime.Round(time.Millisecond), strings.Join(rec, ", "), dup.total(), dup, lag, dup.saveTasks, dup.loadTasks, redelivered, republished)
}

// waitDone waits until at least n requests are done and returns that
// snapshot; it fails the test when the run ends first.
func waitDone(t *testing.T, progress <-chan sim.Progress, done <-chan runResult, n int) sim.Progress {
	t.Helper()
	for {
		select {
		case p := <-progress:
			if p.Done >= n {
				return p
			}
		case r := <-done:
			t.Fatalf("the run ended (err %v) before %d requests were done", r.err, n)
		}
	}
}

// watchAfterKill follows the run from a kill at done requests done until
// until are done, or the run ends (end is then its result, else nil). It
// returns how long after the kill the next request was done (-1: none
// was) and the longest wait, from the kill on, for a request to be done.
func watchAfterKill(progress <-chan sim.Progress, done <-chan runResult, n, until int) (first, stall time.Duration, end *runResult) {
	first = -1
	killed := time.Now()
	last := killed
	for {
		select {
		case p := <-progress:
			if p.Done <= n {
				continue
			}
			now := time.Now()
			if first < 0 {
				first = now.Sub(killed)
			}
			stall, last, n = max(stall, now.Sub(last)), now, p.Done
			if p.Done >= until {
				return first, stall, nil
			}
		case r := <-done:
			return first, stall, &r
		}
	}
}

// busier returns service's replica with the larger work counter, the
// other, and their counters.
func busier(t *testing.T, s *stack, service string) (victim, survivor string, vw, sw float64) {
	t.Helper()
	names := s.names(service)
	if len(names) != 2 {
		t.Fatalf("%s has %d replicas, want 2", service, len(names))
	}
	a, b := workCounter(t, s, names[0], workCounters[service]), workCounter(t, s, names[1], workCounters[service])
	if b > a {
		return names[1], names[0], b, a
	}
	return names[0], names[1], a, b
}

// workCounter sums every series of family on process name's /metrics.
func workCounter(t *testing.T, s *stack, name, family string) float64 {
	t.Helper()
	resp, err := http.Get(s.url(name) + "/metrics")
	if err != nil {
		t.Fatalf("scrape %s: %v", name, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("scrape %s: %s", name, resp.Status)
	}
	sum, seen := 0.0, false
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		rest, ok := strings.CutPrefix(line, family)
		if !ok || (rest != "" && rest[0] != '{' && rest[0] != ' ') {
			continue
		}
		f := strings.Fields(line)
		v, err := strconv.ParseFloat(f[len(f)-1], 64)
		if err != nil {
			t.Fatalf("scrape %s: %q: %v", name, line, err)
		}
		sum, seen = sum+v, true
	}
	if err := sc.Err(); err != nil {
		t.Fatalf("scrape %s: %v", name, err)
	}
	if !seen {
		t.Fatalf("%s serves no %s", name, family)
	}
	return sum
}

// duplicates counts duplicated effects found in the database.
type duplicates struct {
	saveTasks, loadTasks                       int // emitted
	saveTwice, loadTwice, resultTwice, fsTwice int
	outcomeMissing, outcomeUnknown             int
	resultsNotOne                              int
}

func (d duplicates) total() int {
	return d.saveTwice + d.loadTwice + d.resultTwice + d.fsTwice + d.outcomeMissing + d.outcomeUnknown + d.resultsNotOne
}

func (d duplicates) String() string {
	return fmt.Sprintf("save tasks twice %d, load tasks twice %d, save results twice %d, finished_sending twice %d, save outcomes missing %d / unknown %d, tasks without exactly one applied result %d",
		d.saveTwice, d.loadTwice, d.resultTwice, d.fsTwice, d.outcomeMissing, d.outcomeUnknown, d.resultsNotOne)
}

// checkNoDuplicateEffects reads the outbox, save_outcomes and
// processed_records and fails the test on any duplicated or missing
// effect: a save or load task id in two outbox rows, two transfer results
// of one save task, two finished_sending for one request, a save task
// without its one save_outcomes row (or an outcome of no emitted task), or
// a task whose result the scheduler did not apply exactly once.
func checkNoDuplicateEffects(ctx context.Context, t *testing.T, s *stack) duplicates {
	t.Helper()
	conn, err := pgx.Connect(ctx, s.mesh.DatabaseURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	var d duplicates
	saves := map[string]int{}   // save task id → outbox rows
	loads := map[string]int{}   // load task id → outbox rows
	results := map[string]int{} // save task id → transfer result rows
	freed := map[string]int{}   // engine/request → finished_sending rows
	rows, err := conn.Query(ctx, `SELECT topic, value FROM outbox WHERE topic = ANY($1) ORDER BY id`,
		[]string{contract.TopicSaveTasks, contract.TopicLoadTasks, contract.TopicTransferResults, contract.TopicEngineFeedback})
	if err != nil {
		t.Fatal(err)
	}
	var topic string
	var value []byte
	_, err = pgx.ForEachRow(rows, []any{&topic, &value}, func() error {
		switch topic {
		case contract.TopicSaveTasks:
			task, err := kvcore.DecodeSaveTask(value)
			if err != nil {
				return err
			}
			saves[task.TaskID]++
		case contract.TopicLoadTasks:
			var task kvcore.LoadTask
			if err := json.Unmarshal(value, &task); err != nil || task.TaskID == "" {
				return fmt.Errorf("load task %q: %v", value, err)
			}
			loads[task.TaskID]++
		case contract.TopicTransferResults:
			var r contract.TransferResult
			if err := json.Unmarshal(value, &r); err != nil {
				return err
			}
			if r.Kind == contract.TransferSave {
				results[r.TaskID]++
			}
		case contract.TopicEngineFeedback:
			fs, err := contract.DecodeEngineFeedback(value)
			if err != nil {
				return err
			}
			for _, f := range fs {
				if f.Kind == kvcore.FeedbackFinishedSending {
					freed[f.EngineID+"/"+f.RequestID]++
				}
			}
		}
		return nil
	})
	if err != nil {
		t.Fatalf("reading the outbox: %v", err)
	}
	twice := func(what string, m map[string]int) int {
		n := 0
		for k, c := range m {
			if c > 1 {
				n++
				t.Errorf("%s %s: %d outbox rows", what, k, c)
			}
		}
		return n
	}
	d.saveTasks, d.loadTasks = len(saves), len(loads)
	d.saveTwice, d.loadTwice = twice("save task", saves), twice("load task", loads)
	d.resultTwice, d.fsTwice = twice("transfer result of save", results), twice("finished_sending of", freed)
	if len(saves) == 0 || len(loads) == 0 || len(freed) == 0 {
		t.Errorf("the outbox holds %d save tasks, %d load tasks and %d finished_sending: the run emitted too little to check", len(saves), len(loads), len(freed))
	}

	// One save outcome per emitted save task, and the scheduler applied
	// each task's result once (processed_records of kind result).
	applied := map[string]int{} // result id → processed_records rows
	rows, err = conn.Query(ctx, `SELECT id FROM processed_records WHERE kind = 'result'`)
	if err != nil {
		t.Fatal(err)
	}
	var id string
	if _, err := pgx.ForEachRow(rows, []any{&id}, func() error { applied[id]++; return nil }); err != nil {
		t.Fatal(err)
	}
	outcomes := map[string]string{} // task id → result id
	rows, err = conn.Query(ctx, `SELECT task_id, result_id FROM save_outcomes`)
	if err != nil {
		t.Fatal(err)
	}
	var task, result string
	if _, err := pgx.ForEachRow(rows, []any{&task, &result}, func() error { outcomes[task] = result; return nil }); err != nil {
		t.Fatal(err)
	}
	for task := range saves {
		result, ok := outcomes[task]
		switch {
		case !ok:
			d.outcomeMissing++
			t.Errorf("save task %s has no save_outcomes row", task)
		case applied[result] != 1:
			d.resultsNotOne++
			t.Errorf("save task %s: its result %s was applied %d times", task, result, applied[result])
		}
	}
	for task := range outcomes {
		if saves[task] == 0 {
			d.outcomeUnknown++
			t.Errorf("save_outcomes row of %s, a task the outbox never held", task)
		}
	}
	for task := range loads {
		n := 0
		for rid, c := range applied {
			if strings.HasPrefix(rid, "load:"+task+":") {
				n += c
			}
		}
		if n != 1 {
			d.resultsNotOne++
			t.Errorf("load task %s: %d results applied", task, n)
		}
	}
	if t.Failed() {
		t.FailNow()
	}
	return d
}

// republishedRecords counts, per topic, the records on the save and load
// task and engine feedback topics that repeat an earlier record's value:
// outbox rows a killed relay published but could not mark sent, which
// another relay published again. It is a figure, not a failure: the
// outbox guarantees at least once, and the consumers ignore repeats.
func republishedRecords(ctx context.Context, t *testing.T, s *stack) map[string]int {
	t.Helper()
	out := map[string]int{}
	for _, topic := range []string{contract.TopicSaveTasks, contract.TopicLoadTasks, contract.TopicEngineFeedback} {
		recs, err := sim.ReadAll(ctx, s.brokers, topic)
		if err != nil {
			t.Fatal(err)
		}
		seen := map[string]bool{}
		for _, rec := range recs {
			v := rec.Key + "\x00" + string(rec.Value)
			if seen[v] {
				out[topic]++
			}
			seen[v] = true
		}
	}
	return out
}

// groupReader reads consumer-group state from the broker.
type groupReader struct {
	t     *testing.T
	admin *kadm.Client
	lag   *bus.LagCollector
}

func newGroupReader(t *testing.T, brokers []string) *groupReader {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...))
	if err != nil {
		t.Fatal(err)
	}
	lag := bus.NewLagCollector(brokers)
	t.Cleanup(func() { cl.Close(); lag.Close() })
	return &groupReader{t: t, admin: kadm.NewClient(cl), lag: lag}
}

// groupState is one group's membership as the broker describes it.
type groupState struct {
	state     string
	members   int
	assigned  int // partitions of the group's topics assigned to a member
	partsWant int // partitions its topics have
}

func (g *groupReader) describe(ctx context.Context, group string) (groupState, error) {
	var st groupState
	described, err := g.admin.DescribeGroups(ctx, group)
	if err != nil {
		return st, err
	}
	d, ok := described[group]
	if !ok || d.Err != nil {
		return st, fmt.Errorf("describe %s: %v", group, d.Err)
	}
	st.state, st.members = d.State, len(d.Members)
	assigned := d.AssignedPartitions()
	ends, err := g.admin.ListEndOffsets(ctx, groupTopics[group]...)
	if err != nil {
		return st, err
	}
	ends.Each(func(o kadm.ListedOffset) {
		st.partsWant++
		if _, ok := assigned[o.Topic][o.Partition]; ok {
			st.assigned++
		}
	})
	return st, nil
}

// waitMembers waits until group is stable with n members.
func (g *groupReader) waitMembers(ctx context.Context, group string, n int) {
	g.t.Helper()
	var st groupState
	var err error
	if !poll(ctx, 60*time.Second, func() bool {
		st, err = g.describe(ctx, group)
		return err == nil && st.state == "Stable" && st.members == n
	}) {
		g.t.Fatalf("group %s: %+v (err %v), want stable with %d members", group, st, err, n)
	}
}

// waitTakenOver waits until group is stable with the survivors' members
// only, every partition of its topics assigned, and every record committed
// (lag 0 on each topic); it returns the lag summed over the topics.
func (g *groupReader) waitTakenOver(ctx context.Context, group string, members int) int64 {
	g.t.Helper()
	var st groupState
	var lag map[string]int64
	var err error
	ok := poll(ctx, 30*time.Second, func() bool {
		if st, err = g.describe(ctx, group); err != nil || st.state != "Stable" || st.members != members || st.assigned != st.partsWant {
			return false
		}
		if lag, err = g.lag.Lag(ctx, group, groupTopics[group]); err != nil {
			return false
		}
		for _, n := range lag {
			if n != 0 {
				return false
			}
		}
		return true
	})
	if !ok {
		g.t.Fatalf("group %s after the run: %+v, lag %v (err %v): want stable with %d members owning all %d partitions and lag 0",
			group, st, lag, err, members, st.partsWant)
	}
	var total int64
	for _, n := range lag {
		total += n
	}
	g.t.Logf("group %s: %d members own all %d partitions, lag %v", group, st.members, st.partsWant, lag)
	return total
}
