package requeststate

import (
	"strconv"
	"testing"

	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// BenchmarkTrackerStep256 measures one engine step of 256 running requests
// on the hybrid-mla-linear preset: each request appends one block per group
// and emits the save of that block (the scheduler block size is 16), and
// the sender's report of its previous save is applied. A request that
// reaches 1024 tokens is replaced by a new one, as a busy engine would.
func BenchmarkTrackerStep256(b *testing.B) {
	m, err := kvcore.Preset("hybrid-mla-linear")
	if err != nil {
		b.Fatal(err)
	}
	const requests, maxBlocks = 256, 64
	hashes := trkHashes(maxBlocks)
	admit := func(i int) *Tracker {
		tr := NewTracker(m, "engine-0", "req-"+strconv.Itoa(i))
		tr.OnAdmit(hashes, 0)
		eff := tr.Step(m, kvcore.Step{Kind: kvcore.StepNew, Tokens: 16, Table: kvcore.BlockTable{{0}, {0}}})
		if len(eff.Saves) != 1 {
			b.Fatalf("new request did not save: %+v", eff)
		}
		return tr
	}
	trackers := make([]*Tracker, requests)
	last := make([]string, requests)
	for i := range trackers {
		trackers[i] = admit(i)
		last[i] = trackers[i].PendingSaves[0]
	}
	newBlocks := kvcore.BlockTable{{7}, {7}}
	b.ReportAllocs()
	b.ResetTimer()
	saves := 0
	for b.Loop() {
		for i, tr := range trackers {
			if tr.TokenLen >= maxBlocks*16 {
				tr = admit(i)
				trackers[i] = tr
				last[i] = tr.PendingSaves[0]
			}
			eff := tr.Step(m, kvcore.Step{Kind: kvcore.StepRunning, Tokens: tr.TokenLen + 16, Table: newBlocks})
			tr.OnSaveResult(last[i], kvcore.SaveStored)
			if len(eff.Saves) == 1 {
				last[i] = eff.Saves[0].TaskID
				saves++
			}
		}
	}
	if saves == 0 {
		b.Fatal("no save emitted")
	}
}
