package contract_test

import (
	"testing"

	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// TestSaveReportOf: what the tracker learns from a save result's groups —
// keys skipped, failed, and dead-lettered exists_failed (a transient store
// problem vLLM's next job retries) mark the range unsaved; keys
// dead-lettered for a permanent cause do not.
func TestSaveReportOf(t *testing.T) {
	tests := []struct {
		name   string
		status kvcore.SaveStatus
		groups []contract.GroupOutcome
		want   kvcore.SaveReport
	}{
		{"stored", kvcore.SaveStored, []contract.GroupOutcome{{Group: 0, Stored: 4}}, kvcore.SaveReport{Status: kvcore.SaveStored}},
		{"skipped and failed summed", kvcore.SaveSkipped,
			[]contract.GroupOutcome{{Group: 0, Skipped: 2}, {Group: 1, Failed: 1, Skipped: 1}},
			kvcore.SaveReport{Status: kvcore.SaveSkipped, Skipped: 3, Failed: 1}},
		{"exists_failed counts", kvcore.SaveDeadLettered,
			[]contract.GroupOutcome{{Group: 0, DeadLettered: 3, Reason: string(kvcore.ReasonExistsFailed)}},
			kvcore.SaveReport{Status: kvcore.SaveDeadLettered, ExistsFailed: 3}},
		{"block_not_held does not", kvcore.SaveDeadLettered,
			[]contract.GroupOutcome{{Group: 0, DeadLettered: 2, Reason: string(kvcore.ReasonBlockNotHeld)}},
			kvcore.SaveReport{Status: kvcore.SaveDeadLettered}},
		{"negative counts ignored", kvcore.SaveFailed,
			[]contract.GroupOutcome{{Group: 0, Failed: -1, DeadLettered: -2, Reason: string(kvcore.ReasonExistsFailed)}},
			kvcore.SaveReport{Status: kvcore.SaveFailed}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := contract.SaveReportOf(tt.status, tt.groups); got != tt.want {
				t.Fatalf("SaveReportOf = %+v, want %+v", got, tt.want)
			}
		})
	}
}
