package requeststate

import (
	"errors"
	"testing"

	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// TestEngineVersionAdmission: with the model's spec pinning an engine
// version, an engine stating another stops its request at admission
// (request_error, no task afterwards); the pinned version, or none stated,
// admits it and its saves follow. Without a pin any version is admitted.
func TestEngineVersionAdmission(t *testing.T) {
	cases := []struct {
		name           string
		pinned, stated string
		want           error
	}{
		{"pinned, same", "0.11.2", "0.11.2", nil},
		{"pinned, not stated", "0.11.2", "", nil},
		{"pinned, another", "0.11.2", "0.12.0", kvcore.ErrEngineVersion},
		{"not pinned", "", "0.12.0", nil},
		{"malformed", "", "0.12 0", kvcore.ErrBadEngineVersion},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			m, err := kvcore.Preset("hybrid-mla-linear")
			if err != nil {
				t.Fatal(err)
			}
			m.EngineVersion = tc.pinned
			h := &harness{t: t, m: m, r: New(m, "e1", "r1")}
			o := h.event(contract.RequestEvent{Kind: contract.EventAdmitted, PromptTokens: 48, BlockHashes: hashes(8), EngineVersion: tc.stated})
			if tc.want != nil {
				if !o.Errored || h.r.State() != StateErrored || len(o.Errors) == 0 || !errors.Is(o.Errors[0], tc.want) {
					t.Fatalf("admission: %+v, state %s; want stopped with %v", o, h.r.State(), tc.want)
				}
				if len(o.Feedback) == 0 || o.Feedback[0].Kind != contract.FeedbackRequestError {
					t.Fatalf("feedback %+v, want request_error", o.Feedback)
				}
			} else if o.Errored {
				t.Fatalf("admission: %+v, want admitted", o)
			}
			want(t, h.alloc(0, table(0, 3), ""), [3]int{}, "allocation")
			o = h.step(kvcore.Step{Kind: kvcore.StepNew, Tokens: 48, Table: table(0, 3)})
			if stopped := tc.want != nil; stopped != (len(o.Saves) == 0) {
				t.Fatalf("saves %d after admission (stopped %v)", len(o.Saves), stopped)
			}
		})
	}
}
