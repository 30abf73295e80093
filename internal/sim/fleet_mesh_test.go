package sim

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// TestMixedFleetOnMesh plays three models at once through one mesh that
// serves them all (KVMESH_MODEL the seed's hybrid MLA + linear model at
// TP8, KVMESH_MODELS full + SWA + Mamba at TP1 and dense-8b), an engine of
// each with its own model's gpuworkers (eight for TP8). Every engine plays
// the same prompts with the same salt, so that where two models' hash
// blocks agree their hash chains are identical and only the keys' model
// and fingerprint keep them apart. Then it replays the fleet on fresh
// engines, which must load from the store. Every run of every model is
// clean: every request ok, every loaded block right byte for byte against
// its own model's layout, the save ledger balanced with every stored key
// of its own model, every stored value right, every tracker done; the
// replay loads from the store for every model.
func TestMixedFleetOnMesh(t *testing.T) {
	others := []string{"full-swa-mamba", "dense"}
	base, m := simMeshOf(t, meshOptions{model: "hybrid-mla-linear-tp8", connectors: "store", poolBlocks: 64, engines: 1,
		env: []string{"KVMESH_MODELS=" + strings.Join(others, ",")}},
		tp2Workload(6), EngineConfig{PoolBlocks: 48, MaxBatchTokens: 256, MaxRunning: 8, Watermark: 1})
	base.ReusePreempted = true
	cfgs := []Config{base}
	for _, name := range others {
		model, err := kvcore.Preset(name)
		if err != nil {
			t.Fatal(err)
		}
		id := "e-" + name
		if err := startRankWorkers(m, model, []string{id}, "KVMESH_POOL_BLOCKS=64", "KVMESH_MODEL="+name); err != nil {
			t.Fatal(err)
		}
		cfg := base
		cfg.Model, cfg.Fleet = model, []Pair{{Decode: Endpoint{EngineID: id, WorkerURLs: []string{m.Procs.Process(rankWorkerName(id, 0)).URL()}}}}
		cfgs = append(cfgs, cfg)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	first := runFleet(ctx, t, retag(cfgs))
	for _, rep := range first.Models {
		if rep.Ledger.Stored == 0 {
			t.Fatalf("model %s stored nothing: %+v", rep.Model, rep.Ledger)
		}
	}
	replay := runFleet(ctx, t, retag(cfgs))
	for _, rep := range replay.Models {
		if rep.Tokens.Loaded["store"] == 0 || rep.Verification.VerifiedBlocks == 0 {
			t.Fatalf("replay of model %s: loaded %v, %d blocks verified; want its own saves loaded and verified",
				rep.Model, rep.Tokens.Loaded, rep.Verification.VerifiedBlocks)
		}
	}
}

// retag gives each run of cfgs a fresh run tag of its own, keeping their
// one salt.
func retag(cfgs []Config) []Config {
	out := make([]Config, len(cfgs))
	tag := NewRunTag()
	for i, c := range cfgs {
		c.RunTag = fmt.Sprintf("%s-m%d", tag, i)
		out[i] = c
	}
	return out
}

// runFleet plays cfgs at once and requires every model's report clean.
func runFleet(ctx context.Context, t *testing.T, cfgs []Config) *FleetReport {
	t.Helper()
	rep, err := RunFleet(ctx, cfgs)
	var b strings.Builder
	if rep != nil {
		_ = rep.WriteText(&b)
	}
	t.Logf("fleet report:\n%s", b.String())
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range rep.Models {
		requireClean(t, r)
	}
	if !rep.OK {
		t.Fatal("fleet not clean")
	}
	return rep
}
