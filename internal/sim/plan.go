package sim

import (
	"fmt"
	"time"
)

// WorkloadPlan is the exact workload the simulator plays for a Workload and
// a run tag, request by request, for another engine (the Python vLLM
// connector's harness) to play the same prompts and replies against the
// mesh. It is what Generate builds, flattened: the simulator and the plan
// share the one generator.
type WorkloadPlan struct {
	// RunTag prefixes every request id (Config.RunTag).
	RunTag string `json:"run_tag"`
	// Salt is mixed into every block hash (Config.Salt); PlanWorkload
	// leaves it empty, as the simulator's default is: a caller that plays
	// the plan salted sets it.
	Salt string `json:"salt,omitempty"`
	// HashBlockSize is the model's hash block size (kvcore.Model
	// HashBlockSize); PlanWorkload knows no model and leaves it 0 for the
	// caller to set.
	HashBlockSize int `json:"hash_block_size,omitempty"`
	// Requests are every turn of every conversation, conversation by
	// conversation and turn by turn within one.
	Requests []PlannedRequest `json:"requests"`
}

// PlannedRequest is one turn of one conversation as the simulator plays it.
type PlannedRequest struct {
	// RequestID is the id the simulator gives the turn (RequestID).
	RequestID string `json:"request_id"`
	// Conversation and Turn number the conversation and its turn from 0.
	Conversation int `json:"conversation"`
	Turn         int `json:"turn"`
	// After is the request id of the conversation's previous turn, which
	// must have generated its reply before this one is sent; empty for a
	// conversation's first turn.
	After string `json:"after"`
	// StartMs is when a first turn arrives, in milliseconds from the start
	// of the run (the workload's Poisson arrivals); 0 for later turns.
	StartMs float64 `json:"start_ms,omitempty"`
	// ThinkTimeMs is the pause, in milliseconds, between After's reply and
	// this turn (Workload.ThinkTime); 0 for a first turn.
	ThinkTimeMs float64 `json:"think_time_ms,omitempty"`
	// Tenant is the conversation's tenant; empty for none.
	Tenant string `json:"tenant"`
	// PromptTokenIDs is the whole prompt: the system prompt, every earlier
	// turn with its reply, and this turn's user message.
	PromptTokenIDs []int `json:"prompt_token_ids"`
	// OutputTokenIDs is the reply the engine generates, token by token
	// (the simulator's decode tokens).
	OutputTokenIDs []int `json:"output_token_ids"`
}

// RequestID is the request id of turn turn of conversation conv in the run
// tagged runTag: "{runTag}-c{conv:04}-t{turn:02}".
func RequestID(runTag string, conv, turn int) string {
	return fmt.Sprintf("%s-c%04d-t%02d", runTag, conv, turn)
}

// PlanWorkload lists every request the simulator plays for w in the run
// tagged runTag, with the prompts and replies Generate builds for it.
func PlanWorkload(w Workload, runTag string) (WorkloadPlan, error) {
	if runTag == "" {
		return WorkloadPlan{}, fmt.Errorf("plan: empty run tag: %w", ErrConfig)
	}
	convs, err := Generate(w)
	if err != nil {
		return WorkloadPlan{}, fmt.Errorf("plan: %w", err)
	}
	plan := WorkloadPlan{RunTag: runTag}
	for _, c := range convs {
		for t, turn := range c.Turns {
			p := PlannedRequest{
				RequestID: RequestID(runTag, c.Index, t), Conversation: c.Index, Turn: t, Tenant: c.Tenant,
				PromptTokenIDs: tokenIDs(c.Prompt(t)), OutputTokenIDs: tokenIDs(turn.Output),
			}
			if t == 0 {
				p.StartMs = millis(c.Start)
			} else {
				p.After, p.ThinkTimeMs = RequestID(runTag, c.Index, t-1), millis(w.ThinkTime)
			}
			plan.Requests = append(plan.Requests, p)
		}
	}
	return plan, nil
}

// tokenIDs converts token ids for JSON.
func tokenIDs(tokens []uint32) []int {
	out := make([]int, len(tokens))
	for i, tok := range tokens {
		out[i] = int(tok)
	}
	return out
}

// millis is d in milliseconds.
func millis(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
