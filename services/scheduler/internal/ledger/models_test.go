package ledger_test

import (
	"context"
	"testing"

	"github.com/kvmesh/kvmesh/internal/dbtest"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/services/scheduler/internal/ledger"
	"github.com/kvmesh/kvmesh/services/scheduler/requeststate"
)

// TestManyModels: a ledger serving dense (the default) and
// hybrid-mla-linear creates each request's row with the default model and
// lays it out for the model its first engine event names: a hybrid
// request's row and tracker are of hybrid-mla-linear, with its two
// groups' coverage, and it runs; a dense request stays dense; a request of
// a model the mesh does not serve fails closed (errored, naming the
// model), never driven with another model's layout.
func TestManyModels(t *testing.T) {
	pool := dbtest.NewPool(t)
	dense, hybrid := preset(t, "dense"), preset(t, "hybrid-mla-linear")
	models, err := kvcore.NewModels("", dense, hybrid)
	if err != nil {
		t.Fatal(err)
	}
	l := ledger.New(pool, dense, ledger.WithModels(models))
	ctx := context.Background()
	apply := func(id, model string) {
		t.Helper()
		ev := requeststate.EngineEvent{Model: model, Event: contract.RequestEvent{RequestID: id, Seq: 1, Kind: contract.EventAdmitted,
			PromptTokens: 32, BlockHashes: []string{hashHex(1), hashHex(2)}}}
		u := ledger.Unit{Record: ledger.Record{Kind: ledger.KindStep, ID: "step-" + id, EngineID: "e1"},
			Changes: []ledger.Change{{RequestID: id, Create: true, Event: ev}}}
		if st, err := l.ApplyBatch(ctx, []ledger.Unit{u}); err != nil || st[0] != ledger.Applied {
			t.Fatalf("apply %s: %v %v", id, st, err)
		}
	}
	apply("r-hybrid", hybrid.Name)
	apply("r-dense", dense.Name)
	apply("r-llama", "llama-70b")
	for _, c := range []struct {
		id, model, state string
		groups           int
	}{
		{"r-hybrid", hybrid.Name, string(requeststate.StateWaiting), len(hybrid.Groups)},
		{"r-dense", dense.Name, string(requeststate.StateWaiting), len(dense.Groups)},
		{"r-llama", dense.Name, string(requeststate.StateErrored), len(dense.Groups)},
	} {
		row, err := l.Get(ctx, ledger.Key{EngineID: "e1", RequestID: c.id})
		if err != nil {
			t.Fatal(err)
		}
		req, _ := row.Request()
		if row.Model != c.model || req.Store.Model != c.model || row.State != c.state || len(req.Coverage) != c.groups {
			t.Errorf("%s: row model %q, tracker %q, state %s, %d groups; want %q, %s, %d (error %q)",
				c.id, row.Model, req.Store.Model, row.State, len(req.Coverage), c.model, c.state, c.groups, row.Error)
		}
	}
}

func preset(t *testing.T, name string) *kvcore.Model {
	t.Helper()
	m, err := kvcore.Preset(name)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

func hashHex(i byte) string { return kvcore.BlockHash{i}.Hex() }
