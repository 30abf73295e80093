package app_test

import (
	"slices"
	"testing"

	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/services/scheduler/internal/app"
)

// promptIDs is n token ids.
func promptIDs(n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(7000 + 3*i)
	}
	return out
}

// saveTokens drives one request admitted with tokens through a full
// prefill and returns its save task.
func saveTokens(t *testing.T, h *mesh, tokens []uint32) kvcore.SaveTask {
	t.Helper()
	r := h.request("tokens")
	r.event(contract.RequestEvent{Kind: contract.EventAdmitted, PromptTokens: 64, BlockHashes: hashes(4),
		TokenIDs: tokens, LoraName: "sql-lora"})
	r.allocate(0, table(0, 4), "")
	r.step(kvcore.Step{Kind: kvcore.StepNew, Tokens: 64, Table: table(0, 4)})
	task := r.waitSaves(1)[0]
	if det := r.settled(); det.Tracker == nil || len(det.Tracker.TokenIDs) != len(task.TokenIDs) {
		t.Fatalf("stored tracker %+v: want the task's %d tokens", det.Tracker, len(task.TokenIDs))
	}
	return task
}

// TestTokenIDsFlowIntoSaveTasks: the token ids of an admitted event are
// kept with the request and put on its save task with its LoRA name,
// unless KVMESH_KV_EVENTS_TOKEN_IDS is false; a malformed list
// dead-letters its step record (invalid_record), as a malformed hash
// chain does, and the request it named is never created.
func TestTokenIDsFlowIntoSaveTasks(t *testing.T) {
	cases := []struct {
		name string
		keep bool
		want int
	}{
		{"kept", true, 64},
		{"dropped", false, 0},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			h := newMesh(t, meshOptions{consumers: 1, config: func(cfg *app.Config) { cfg.KVEventsTokenIDs = c.keep }})
			task := saveTokens(t, h, promptIDs(64))
			if !slices.Equal(task.TokenIDs, promptIDs(c.want)) || task.LoraName != "sql-lora" {
				t.Fatalf("save task with %d tokens, lora %q; want %d, sql-lora", len(task.TokenIDs), task.LoraName, c.want)
			}
			bad := h.request("tokens-bad")
			bad.event(contract.RequestEvent{Kind: contract.EventAdmitted, PromptTokens: 64, BlockHashes: hashes(4),
				TokenIDs: promptIDs(20)})
			var reason string
			eventually(t, "the malformed token list's dead letter", func() bool {
				err := h.pool.QueryRow(h.ctx, `SELECT reason FROM dead_letters WHERE service = 'scheduler' AND record_key = $1`, bad.engine).Scan(&reason)
				return err == nil
			})
			if reason != "invalid_record" {
				t.Fatalf("dead letter reason %q, want invalid_record", reason)
			}
			if _, ok := bad.detail(); ok {
				t.Fatal("the request of a dead-lettered step was created")
			}
		})
	}
}
