package app_test

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/internal/servicetest"
	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/service"
	"github.com/kvmesh/kvmesh/services/gpuworker/internal/app"
)

// TestRankMustBeAWorkerRankOfTheModel: a worker whose KVMESH_RANK_* is not
// one of the model's worker ranks (with the KVMESH_TP/PCP/DCP/PP
// overrides) is a configuration error that says which ranks are valid.
func TestRankMustBeAWorkerRankOfTheModel(t *testing.T) {
	t.Parallel()
	env := servicetest.NewEnv(t)
	tests := []struct {
		name     string
		model    string
		parallel service.ParallelOverride
		rank     kvcore.Rank
		want     []string // substrings of the error; none: valid
	}{
		{"TP8 rank 7", "hybrid-mla-linear-tp8", service.ParallelOverride{}, kvcore.Rank{TP: 7}, nil},
		{"TP8 rank 8", "hybrid-mla-linear-tp8", service.ParallelOverride{}, kvcore.Rank{TP: 8},
			[]string{"KVMESH_RANK_*", "rank tp8-pcp0-dcp0-pp0", "KVMESH_RANK_TP 0..7", "tp7-pcp0-dcp0-pp0"}},
		{"TP1 rank 1", "hybrid-mla-linear", service.ParallelOverride{}, kvcore.Rank{TP: 1},
			[]string{"KVMESH_RANK_TP 0..0", ": tp0-pcp0-dcp0-pp0"}},
		{"KVMESH_TP=2 rank 1", "hybrid-mla-linear", service.ParallelOverride{TP: 2}, kvcore.Rank{TP: 1}, nil},
		{"PP rank past PP", "hybrid-mla-linear", service.ParallelOverride{PP: 2}, kvcore.Rank{PP: 2},
			[]string{"KVMESH_RANK_PP 0..1"}},
		{"DCP rank tp % dcp", "dense", service.ParallelOverride{TP: 4, DCP: 2}, kvcore.Rank{TP: 3, DCP: 1}, nil},
		{"DCP rank not tp % dcp", "dense", service.ParallelOverride{TP: 4, DCP: 2}, kvcore.Rank{TP: 1},
			[]string{"rank tp1-pcp0-dcp0-pp0", "KVMESH_RANK_DCP = KVMESH_RANK_TP % 2 (1 for KVMESH_RANK_TP 1)", "tp1-pcp0-dcp1-pp0"}},
		{"unknown model", "no-such-model", service.ParallelOverride{}, kvcore.Rank{}, []string{"KVMESH_MODEL"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cfg := testConfig(env, "engine-rank")
			cfg.Model, cfg.Parallel = tc.model, tc.parallel
			cfg.RankTP, cfg.RankPCP, cfg.RankDCP, cfg.RankPP = tc.rank.TP, tc.rank.PCP, tc.rank.DCP, tc.rank.PP
			err := cfg.Validate()
			if len(tc.want) == 0 {
				if err != nil {
					t.Fatalf("Validate = %v, want a valid rank", err)
				}
				return
			}
			if err == nil {
				t.Fatalf("Validate accepted rank %s", tc.rank)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("Validate = %v, want it to say %q", err, w)
				}
			}
			if _, err := app.New(context.Background(), cfg, nil); err == nil {
				t.Fatal("New accepted a rank outside the model")
			}
		})
	}
}

// TestWorkerOfNoRankExitsWithConfigurationError runs the binary as rank 8
// of the TP8 model: it exits at once with status 2 (bad configuration),
// naming the valid ranks.
func TestWorkerOfNoRankExitsWithConfigurationError(t *testing.T) {
	t.Parallel()
	bin := testenv.BuildBinary(t, "./services/gpuworker")
	env := servicetest.NewEnv(t)
	vars := processVars(env, testConfig(env, "engine-rank8"), env.RedisURL)
	vars["KVMESH_MODEL"], vars["KVMESH_RANK_TP"], vars["KVMESH_HTTP_ADDR"] = "hybrid-mla-linear-tp8", "8", "127.0.0.1:0"
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin)
	cmd.Env = []string{"PATH=" + os.Getenv("PATH")}
	for k, v := range vars {
		cmd.Env = append(cmd.Env, k+"="+v)
	}
	var stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stderr, &stderr
	err := cmd.Run()
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() != 2 {
		t.Fatalf("exit = %v, want status 2; output:\n%s", err, stderr.String())
	}
	out := stderr.String()
	if !strings.Contains(out, "configuration") || !strings.Contains(out, "rank tp8-pcp0-dcp0-pp0 is not a worker rank") ||
		!strings.Contains(out, "KVMESH_RANK_TP 0..7") {
		t.Fatalf("output does not name the bad rank and the valid ones:\n%s", out)
	}
}

// TestMultiRankWorkerLoadsOnlyItsTasks runs rank 1 of a TP2 engine
// (KVMESH_TP=2): a task whose Ranks leave it out is skipped without a
// result; the next task, listing it, is loaded and its result names rank
// tp1 with that rank's result id.
func TestMultiRankWorkerLoadsOnlyItsTasks(t *testing.T) {
	t.Parallel()
	env := servicetest.NewEnv(t)
	cfg := testConfig(env, "engine-tp2")
	cfg.Parallel.TP, cfg.RankTP = 2, 1
	w := startWorker(t, cfg, nil)
	w.model.Parallel.TP = 2
	rs := watchResults(t, env)
	p := publisher(t, env)
	hashes := hexChain(w.model, tokens(32, 4100))
	table := kvcore.BlockTable{{1, 2}, {kvcore.NullBlock, 3}}

	other := w.loadTask(hashes, 32, table)
	other.Ranks = []kvcore.Rank{{TP: 0}}
	mine := w.loadTask(hashes, 32, table)
	mine.Ranks = []kvcore.Rank{{TP: 0}, {TP: 1}}
	publishTask(t, p, other) // keyed by engine id: one partition, in order
	publishTask(t, p, mine)

	got := rs.wait(t, mine.TaskID)
	me := kvcore.Rank{TP: 1}
	if got.Rank == nil || *got.Rank != me || got.ResultID != "load:"+mine.TaskID+":tp1-pcp0-dcp0-pp0" {
		t.Fatalf("result %+v, want one of rank %s", got, me)
	}
	if len(got.LoadErrors) != 3 {
		t.Errorf("load errors %v, want the 3 blocks (nothing stored)", got.LoadErrors)
	}
	if skipped := rs.find(other.TaskID); len(skipped) != 0 {
		t.Fatalf("the task of rank tp0 only got results %+v from rank tp1", skipped)
	}
}
