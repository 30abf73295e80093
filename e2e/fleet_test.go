package e2e

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/internal/sim"
	"github.com/kvmesh/kvmesh/pkg/service"
)

// mixedFleet are the engines of TestMixedFleet: the seed's hybrid MLA +
// linear model at TP8 (eight gpuworkers), full + SWA + Mamba at TP1 and a
// dense model, each engine with its own model's gpuworkers.
var mixedFleet = []fleetEngine{
	{name: "gw-hybrid", engine: "e-hybrid-tp8", model: "hybrid-mla-linear-tp8"},
	{name: "gw-mamba", engine: "e-full-swa-mamba", model: "full-swa-mamba"},
	{name: "gw-dense", engine: "e-dense", model: "dense"},
}

// TestMixedFleet plays three models at once through one mesh that serves
// them all (KVMESH_MODEL the seed's TP8 model, KVMESH_MODELS the other
// two), every model's engine playing the same prompts with the same salt,
// so that where two models' hash blocks agree their hash chains are
// identical and only the keys' model and fingerprint keep them apart. Then
// it replays the fleet on fresh engines, which must load from the store.
// Every run of every model is clean: every request ok, every loaded block
// right byte for byte against its own model's layout, the save ledger
// balanced with every stored key of its own model, every stored value
// right, every tracker done; the replay loads from the store for every
// model.
func TestMixedFleet(t *testing.T) {
	s := newStack(t, stackOptions{model: mixedFleet[0].model, connectors: "store", poolBlocks: 64,
		env: []string{"KVMESH_MODELS=" + mixedFleet[1].model + "," + mixedFleet[2].model}, fleet: mixedFleet})
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	salt := sim.NewRunTag()
	first := runFleet(ctx, t, fleetConfigs(t, s, salt))
	for _, rep := range first.Models {
		if rep.Ledger.Stored == 0 {
			t.Fatalf("model %s stored nothing: %+v", rep.Model, rep.Ledger)
		}
	}
	replay := runFleet(ctx, t, fleetConfigs(t, s, salt))
	for _, rep := range replay.Models {
		if rep.Tokens.Loaded["store"] == 0 || rep.Verification.VerifiedBlocks == 0 {
			t.Fatalf("replay of model %s: loaded %v, %d blocks verified; want its own saves loaded and verified",
				rep.Model, rep.Tokens.Loaded, rep.Verification.VerifiedBlocks)
		}
	}
}

// fleetConfigs are the runs of mixedFleet on s: one per model, the same
// workload and salt.
func fleetConfigs(t *testing.T, s *stack, salt string) []sim.Config {
	t.Helper()
	var out []sim.Config
	for _, e := range mixedFleet {
		m, err := service.LoadModel(e.model)
		if err != nil {
			t.Fatal(err)
		}
		cfg := meshSimConfig(s, m, smallWorkload(6, 6))
		cfg.Salt, cfg.Decode = salt, sim.Endpoint{EngineID: e.engine, WorkerURLs: s.fleetURLs(e)}
		out = append(out, cfg)
	}
	return out
}

// runFleet plays cfgs at once and requires every model's report clean.
func runFleet(ctx context.Context, t *testing.T, cfgs []sim.Config) *sim.FleetReport {
	t.Helper()
	rep, err := sim.RunFleet(ctx, cfgs)
	var b strings.Builder
	if rep != nil {
		_ = rep.WriteText(&b)
	}
	t.Logf("fleet report:\n%s", b.String())
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range rep.Models {
		requireOK(t, r)
	}
	if !rep.OK {
		b, _ := json.MarshalIndent(rep, "", "  ")
		t.Fatalf("fleet not clean:\n%s", b)
	}
	return rep
}
