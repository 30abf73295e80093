package app_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/internal/dbtest"
	"github.com/kvmesh/kvmesh/internal/devbroker"
	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// newBroker starts an embedded broker whose topics have partitions
// partitions.
func newBroker(t testing.TB, partitions int) []string {
	t.Helper()
	b, err := devbroker.Start(context.Background(), devbroker.Config{
		Addr: "127.0.0.1:0", Partitions: partitions, GroupMinSessionTimeout: 100 * time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Close)
	return b.Addrs()
}

// TestThousandConcurrentRequests: 1,000 requests over 6 partitions, each
// admitted, scheduled (one save), finished and its save reported, all
// complete with every tracker done and one finished_sending each.
func TestThousandConcurrentRequests(t *testing.T) {
	const n = 1000
	testenv.RedisURL(t) // skip (or fail) with the other service tests
	h := startMesh(t, newBroker(t, 6), dbtest.NewDatabase(t), meshOptions{consumers: 4})
	reqs := make([]*request, n)
	var events []keyed
	for i := range reqs {
		r := h.request(fmt.Sprintf("k%04d", i))
		reqs[i] = r
		for _, ev := range []contract.RequestEvent{
			{Kind: contract.EventAdmitted, PromptTokens: 48, BlockHashes: hashes(3)},
			{Kind: contract.EventScheduled, Step: &kvcore.Step{Kind: kvcore.StepNew, Tokens: 48, Table: table(0, 3)}},
			{Kind: contract.EventFinished},
		} {
			events = append(events, keyed{r.engine, r.fill(ev)})
		}
	}
	start := time.Now()
	h.produce(contract.TopicEngineSteps, events...)
	var results []keyed
	eventually(t, fmt.Sprintf("%d save tasks", n), func() bool {
		h.out.mu.Lock()
		defer h.out.mu.Unlock()
		return len(h.out.records[contract.TopicSaveTasks]) >= n
	})
	saves := map[string][]kvcore.SaveTask{}
	for _, s := range allValues[kvcore.SaveTask](h.out, contract.TopicSaveTasks) {
		saves[s.RequestID] = append(saves[s.RequestID], s)
	}
	for _, r := range reqs {
		s := saves[r.id]
		if len(s) != 1 {
			t.Fatalf("request %s: %d save tasks", r.id, len(s))
		}
		results = append(results, keyed{r.id, contract.TransferResult{Schema: contract.SchemaTransferResult,
			ResultID: "res-" + s[0].TaskID, Kind: contract.TransferSave, TaskID: s[0].TaskID, EngineID: r.engine,
			RequestID: r.id, Status: string(kvcore.SaveStored)}})
	}
	h.produce(contract.TopicTransferResults, results...)
	eventually(t, "every tracker done", func() bool {
		var done int
		err := h.pool.QueryRow(h.ctx, `SELECT count(*) FROM trackers WHERE state = 'done'`).Scan(&done)
		return err == nil && done == n
	})
	t.Logf("%d requests (%d events, %d results) done in %s", n, len(events), len(results), time.Since(start))
	eventually(t, "every finished_sending", func() bool {
		h.out.mu.Lock()
		defer h.out.mu.Unlock()
		return len(h.out.records[contract.TopicEngineFeedback]) >= n
	})
	feedback := map[string][]contract.EngineFeedback{}
	for _, f := range allValues[contract.EngineFeedback](h.out, contract.TopicEngineFeedback) {
		feedback[f.RequestID] = append(feedback[f.RequestID], f)
	}
	for _, r := range reqs {
		if f := feedback[r.id]; len(f) != 1 || f[0].Kind != kvcore.FeedbackFinishedSending || f[0].Immediate {
			t.Fatalf("request %s feedback %+v", r.id, f)
		}
	}
}
