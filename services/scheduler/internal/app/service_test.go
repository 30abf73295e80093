package app_test

import (
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/httpserver"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/services/scheduler/internal/api"
	"github.com/kvmesh/kvmesh/services/scheduler/internal/app"
	"github.com/kvmesh/kvmesh/services/scheduler/requeststate"
)

// TestService covers the scheduler's own guarantees on one running
// scheduler: the seed fix at service level, idempotency, cross-topic
// ordering, the admin API and the metrics.
func TestService(t *testing.T) {
	h := newMesh(t, meshOptions{})
	cases := []struct {
		name string
		run  func(t *testing.T, h *mesh)
	}{
		{"group_count_mismatch_errors_the_request_only", groupCountErrored},
		{"duplicate_and_stale_events_change_nothing", duplicateEvents},
		{"allocation_before_its_decision_is_held", allocationHeld},
		{"decision_before_preemption_survives", decisionBeforePreemption},
		{"invalid_records_dead_lettered_consumer_goes_on", invalidRecords},
		{"admin_list_filters_and_pages", adminList},
	}
	t.Run("cases", func(t *testing.T) {
		for _, c := range cases {
			t.Run(c.name, func(t *testing.T) {
				t.Parallel()
				c.run(t, h.on(t))
			})
		}
	})
	t.Run("metrics", func(t *testing.T) { metrics(t, h.on(t)) })
}

// groupCountErrored: the seed's failure class at service level. A step
// whose table has one group on a two-group model marks that request
// errored with the reason (admin API and feedback), emits no save, and the
// scheduler goes on; the request's finish still frees its blocks.
func groupCountErrored(t *testing.T, h *mesh) {
	r := h.request("seed")
	r.admit(32)
	r.allocate(0, table(0, 2), "")
	r.step(kvcore.Step{Kind: kvcore.StepNew, Tokens: 32, Table: kvcore.BlockTable{{0, 1}}})
	f := r.waitFeedback(contract.FeedbackRequestError)
	d := r.settled()
	if !strings.Contains(f.Error, "group count") || d.State != string(requeststate.StateErrored) || !strings.Contains(d.Error, "1 group") {
		t.Fatalf("feedback %+v, state %s, error %q", f, d.State, d.Error)
	}
	if len(d.Errors) == 0 || d.Errors[0].Source != "request" || len(r.saves()) != 0 {
		t.Fatalf("errors %+v, saves %+v", d.Errors, r.saves())
	}
	ok := h.request("after")
	ok.admit(32)
	ok.allocate(0, table(0, 2), "")
	ok.step(kvcore.Step{Kind: kvcore.StepNew, Tokens: 32, Table: table(0, 2)})
	ok.waitSaves(1)
	r.finish()
	if fs := r.waitFeedback(kvcore.FeedbackFinishedSending); !fs.Immediate {
		t.Fatalf("errored request's finish %+v", fs)
	}
	var page api.Page
	h.get("/v1/requests?engine_id="+r.engine, &page)
	if len(page.Items) != 1 || page.Items[0].State != string(requeststate.StateDone) || page.Items[0].Error == "" {
		t.Fatalf("list after finish %+v", page.Items)
	}
}

// duplicateEvents: the same engine event delivered twice yields one save
// task; another event id with an applied seq is stale and ignored.
func duplicateEvents(t *testing.T, h *mesh) {
	r := h.request("dup")
	r.admit(48)
	r.allocate(0, table(0, 3), "")
	ev := r.fill(contract.RequestEvent{Kind: contract.EventScheduled,
		Step: &kvcore.Step{Kind: kvcore.StepNew, Tokens: 48, Table: table(0, 3)}})
	h.produce(contract.TopicEngineSteps, keyed{r.engine, ev}, keyed{r.engine, ev})
	stale := ev
	stale.StepID += "-again"
	h.produce(contract.TopicEngineSteps, keyed{r.engine, stale})
	r.waitSaves(1)
	var events int
	eventually(t, "all four events recorded", func() bool {
		err := h.pool.QueryRow(h.ctx, `SELECT count(*) FROM processed_records WHERE engine_id = $1 AND kind = 'step'`, r.engine).Scan(&events)
		return err == nil && events == 4
	})
	r.settled()
	if n := len(r.saves()); n != 1 || h.outboxCount(contract.TopicSaveTasks, r.id) != 1 {
		t.Fatalf("%d save tasks on the topic, %d in the outbox; want exactly one", n, h.outboxCount(contract.TopicSaveTasks, r.id))
	}
}

// allocationHeld: an allocation promising external tokens that arrives
// before its lookup decision waits for it (and so do the events after
// it); the decision then issues the load.
func allocationHeld(t *testing.T, h *mesh) {
	r := h.request("held")
	r.admit(48)
	r.allocate(32, table(0, 3), "late")
	r.step(kvcore.Step{Kind: kvcore.StepPendingLoad})
	d := r.settled()
	if d.Held == nil || len(d.Held.Events) != 1 || len(r.loads()) != 0 {
		t.Fatalf("held %+v, loads %+v", d.Held, r.loads())
	}
	r.decide("late", "store", 32, storeChild(32, &kvcore.LoadSpec{KVPoolCachedTokens: 32}))
	l := r.waitLoads(1)
	if l[0].End != 32 {
		t.Fatalf("load %+v", l[0])
	}
	eventually(t, "held released", func() bool { d, _ = r.detail(); return d.Held == nil })
}

// decisionBeforePreemption: a resumed request's lookup decision consumed
// before the preemption event is not wiped by it.
func decisionBeforePreemption(t *testing.T, h *mesh) {
	r := h.request("resume")
	r.admit(48)
	r.allocate(0, table(0, 1), "")
	r.step(kvcore.Step{Kind: kvcore.StepNew, Tokens: 10, Table: table(0, 1)})
	r.applied()
	r.decide("resume-d", "store", 32, storeChild(32, &kvcore.LoadSpec{KVPoolCachedTokens: 32}))
	eventually(t, "decision kept", func() bool { d, _ := r.detail(); return len(d.Decisions) == 1 })
	r.preempt()
	r.allocate(32, table(7, 3), "resume-d")
	r.step(kvcore.Step{Kind: kvcore.StepResumed, Tokens: 48, Table: table(7, 3)})
	l := r.waitLoads(1)
	r.settled()
	if len(r.saves()) != 0 || l[0].End != 32 {
		t.Fatalf("loads %+v saves %+v", l, r.saves())
	}
}

// invalidRecords: undecodable and invalid records are dead-lettered into
// the scheduler's table; the consumer goes on.
func invalidRecords(t *testing.T, h *mesh) {
	key := randomID("bad-")
	h.produce(contract.TopicEngineSteps, keyed{key, "not a step"})
	h.produce(contract.TopicTransferResults, keyed{key, contract.TransferResult{Schema: contract.SchemaTransferResult, ResultID: "x"}})
	var n int
	eventually(t, "two dead letters", func() bool {
		err := h.pool.QueryRow(h.ctx, `SELECT count(*) FROM dead_letters WHERE service = 'scheduler' AND record_key = $1`, key).Scan(&n)
		return err == nil && n == 2
	})
	r := h.request("alive")
	r.admit(16)
	r.allocate(0, table(0, 1), "")
	r.step(kvcore.Step{Kind: kvcore.StepNew, Tokens: 16, Table: table(0, 1)})
	r.waitSaves(1)
}

// adminList: filters, pagination with an opaque cursor, and problem+json
// naming a bad parameter; 404 for an unknown request.
func adminList(t *testing.T, h *mesh) {
	engine := randomID("admin-e-")
	var ids []string
	for i := range 5 {
		r := h.request("admin")
		r.engine = engine
		r.id = fmt.Sprintf("req-%02d", i)
		r.admit(16)
		if i < 2 {
			r.finish()
		}
		r.applied()
		ids = append(ids, r.id)
	}
	var seen []string
	cursor := ""
	for pages := 0; ; pages++ {
		var p api.Page
		if code := h.get("/v1/requests?engine_id="+engine+"&limit=2&cursor="+cursor, &p); code != http.StatusOK {
			t.Fatalf("page %d: %d", pages, code)
		}
		for _, it := range p.Items {
			seen = append(seen, it.RequestID)
		}
		if p.NextCursor == "" {
			break
		}
		cursor = p.NextCursor
	}
	if strings.Join(seen, ",") != strings.Join(ids, ",") {
		t.Fatalf("paged %v, want %v", seen, ids)
	}
	var done api.Page
	h.get("/v1/requests?engine_id="+engine+"&state=done", &done)
	if len(done.Items) != 2 || done.Items[0].RequestID != "req-00" || done.Items[0].FinishedAt == nil {
		t.Fatalf("state=done: %+v", done.Items)
	}
	for param, query := range map[string]string{
		"limit": "limit=0", "state": "state=bogus", "cursor": "cursor=bm90LWpzb24",
	} {
		resp, err := http.Get("http://" + h.addr + "/v1/requests?" + query)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusBadRequest || resp.Header.Get("Content-Type") != httpserver.ContentTypeProblem ||
			!strings.Contains(string(body), `"parameter":"`+param+`"`) {
			t.Fatalf("%s: %d %s %s", query, resp.StatusCode, resp.Header.Get("Content-Type"), body)
		}
	}
	var p httpserver.Problem
	if code := h.get("/v1/requests/"+engine+"/nope", &p); code != http.StatusNotFound || p.Status != http.StatusNotFound {
		t.Fatalf("unknown request: %d %+v", code, p)
	}
	slashed := h.request("admin")
	slashed.engine, slashed.id = engine, "chat/42"
	slashed.admit(16)
	eventually(t, "a request id with a slash", func() bool {
		var d api.Detail
		return h.get("/v1/requests/"+engine+"/"+url.PathEscape(slashed.id), &d) == http.StatusOK && d.RequestID == slashed.id
	})
	// The request's trace: the first traced event's, kept by the tracker
	// for the events after it (which carry none); none for an untraced one.
	const traceID = "4bf92f3577b34da6a3ce929d0e0e4736"
	traced := h.request("admin")
	traced.event(contract.RequestEvent{Kind: contract.EventAdmitted, PromptTokens: 16, BlockHashes: hashes(1),
		Traceparent: "00-" + traceID + "-00f067aa0ba902b7-01"})
	traced.finish()
	if d := traced.applied(); d.TraceID != traceID {
		t.Fatalf("traced request: trace_id %q, want %s", d.TraceID, traceID)
	}
	plain := h.request("admin")
	plain.admit(16)
	if d := plain.applied(); d.TraceID != "" {
		t.Fatalf("untraced request: trace_id %q, want none", d.TraceID)
	}
}

// metrics: the record, task, duplicate and gauge metrics are exposed.
func metrics(t *testing.T, h *mesh) {
	var text string
	eventually(t, "metrics", func() bool {
		resp, err := http.Get("http://" + h.addr + "/metrics")
		if err != nil {
			return false
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		text = string(b)
		return strings.Contains(text, `kvmesh_scheduler_trackers{state="done"}`) &&
			!strings.Contains(text, `kvmesh_scheduler_trackers{state="done"} 0`)
	})
	// Counters may exceed 1 when a rebalance redelivers records (each
	// redelivery is counted as a duplicate), so most are checked as ≥ 1.
	for series, least := range map[string]float64{
		`kvmesh_scheduler_records_total{result="applied",topic="kvmesh.engine.steps"}`:                 1,
		`kvmesh_scheduler_records_total{result="duplicate",topic="kvmesh.engine.steps"}`:               1,
		`kvmesh_scheduler_records_total{result="held",topic="kvmesh.engine.steps"}`:                    1,
		`kvmesh_scheduler_duplicates_total{by="seq",topic="kvmesh.engine.steps"}`:                      1,
		`kvmesh_scheduler_tasks_emitted_total{kind="save",model="test-model"}`:                         1,
		`kvmesh_scheduler_tasks_emitted_total{kind="load",model="test-model"}`:                         1,
		`kvmesh_scheduler_feedback_total{kind="request_error"}`:                                        1,
		`kvmesh_scheduler_dead_letters_total{reason="undecodable",topic="kvmesh.engine.steps"}`:        1,
		`kvmesh_scheduler_dead_letters_total{reason="invalid_record",topic="kvmesh.transfer.results"}`: 1,
		`kvmesh_outbox_backlog`:                      0,
		`kvmesh_scheduler_trackers{state="errored"}`: 0,
	} {
		if v, ok := metricValue(text, series); !ok || v < least {
			t.Errorf("metric %s = %v (present %v), want at least %v:\n%s", series, v, ok, least, grepLines(text, "kvmesh_"))
		}
	}
	// An errored request is counted once, whatever the redeliveries.
	if v, _ := metricValue(text, "kvmesh_scheduler_requests_errored_total"); v != 1 {
		t.Errorf("kvmesh_scheduler_requests_errored_total = %v, want 1", v)
	}
}

// metricValue finds series in a Prometheus text exposition.
func metricValue(text, series string) (float64, bool) {
	for _, l := range strings.Split(text, "\n") {
		if v, ok := strings.CutPrefix(l, series+" "); ok {
			f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
			return f, err == nil
		}
	}
	return 0, false
}

// grepLines returns the lines of text containing substr.
func grepLines(text, substr string) string {
	var out []string
	for _, l := range strings.Split(text, "\n") {
		if strings.Contains(l, substr) && !strings.HasPrefix(l, "#") {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

// TestRetentionPurge: a finished tracker is kept for the retention, then
// purged with its processed-record ids and its sent outbox rows; an
// unfinished one stays.
func TestRetentionPurge(t *testing.T) {
	h := newMesh(t, meshOptions{config: func(c *app.Config) { c.TrackerRetention = 1500 * time.Millisecond }})
	done := h.request("purged")
	done.admit(16)
	done.finish()
	done.waitFeedback(kvcore.FeedbackFinishedSending)
	kept := h.request("kept")
	kept.admit(16)
	kept.applied()
	if _, ok := done.detail(); !ok {
		t.Fatal("finished tracker gone before its retention")
	}
	eventually(t, "the finished tracker purged", func() bool { _, ok := done.detail(); return !ok })
	var records, sent int
	eventually(t, "its processed ids and sent outbox rows purged", func() bool {
		err := h.pool.QueryRow(h.ctx, `SELECT (SELECT count(*) FROM processed_records WHERE request_id = $1),
			(SELECT count(*) FROM outbox WHERE sent_at IS NOT NULL)`, done.id).Scan(&records, &sent)
		return err == nil && records == 0 && sent == 0
	})
	if _, ok := kept.detail(); !ok {
		t.Fatal("an unfinished tracker was purged")
	}
}
