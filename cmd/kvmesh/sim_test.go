package main

import (
	"bytes"
	"errors"
	"io"
	"strings"
	"testing"

	"github.com/kvmesh/kvmesh/internal/sim"
)

func quiet(t *testing.T) {
	t.Helper()
	old := stderr
	stderr = io.Discard
	t.Cleanup(func() { stderr = old })
}

func TestSimFlagsPresetDefaults(t *testing.T) {
	quiet(t)
	t.Setenv("KVMESH_KAFKA_BROKERS", "10.0.0.1:9092, 10.0.0.2:9092")
	o, err := simFlags(nil)
	if err != nil {
		t.Fatal(err)
	}
	seed := simPresets["seed"]
	if !o.cfg.PD || o.cfg.Workload != seed.workload || o.cfg.Engine != seed.engine || o.cfg.Model.Name != "hybrid-mla-linear" {
		t.Fatalf("seed preset not applied: %+v", o.cfg)
	}
	if strings.Join(o.cfg.Brokers, ",") != "10.0.0.1:9092,10.0.0.2:9092" {
		t.Fatalf("brokers %v", o.cfg.Brokers)
	}
	if o.cfg.RunTag == "" || o.cfg.Salt != o.cfg.RunTag {
		t.Fatalf("run tag %q, salt %q: -fresh salts with the run tag", o.cfg.RunTag, o.cfg.Salt)
	}
	if o.cfg.LookupURL != "http://127.0.0.1:8081" || o.cfg.SchedulerURL != "http://127.0.0.1:8082" ||
		o.cfg.SenderURL != "http://127.0.0.1:8083" || o.cfg.Decode.WorkerURL != "http://127.0.0.1:8084" {
		t.Fatalf("addresses %+v", o.cfg)
	}
}

func TestSimFlagsOverride(t *testing.T) {
	quiet(t)
	o, err := simFlags([]string{"-preset", "smoke", "-requests", "5", "-turns", "1-2", "-pd", "-pool-blocks", "9",
		"-model", "full-swa-mamba", "-fresh=false", "-run-tag", "x", "-json", "-scheduler", ""})
	if err != nil {
		t.Fatal(err)
	}
	w := o.cfg.Workload
	if w.Requests != 5 || w.Turns != (sim.Range{Min: 1, Max: 2}) || w.UserTokens != simPresets["smoke"].workload.UserTokens {
		t.Fatalf("workload %+v", w)
	}
	if !o.cfg.PD || o.cfg.Engine.PoolBlocks != 9 || o.cfg.Model.Name != "full-swa-mamba" || !o.json {
		t.Fatalf("config %+v", o.cfg)
	}
	if o.cfg.RunTag != "x" || o.cfg.Salt != "" || o.cfg.SchedulerURL != "" {
		t.Fatalf("run tag %q salt %q scheduler %q", o.cfg.RunTag, o.cfg.Salt, o.cfg.SchedulerURL)
	}
}

func TestSimFlagsErrors(t *testing.T) {
	quiet(t)
	for _, args := range [][]string{
		{"-preset", "nope"},
		{"-turns", "5-2"},
		{"-output-tokens", "many"},
		{"-model", "no-such-model"},
		{"-progress", "sometimes"},
		{"-log-level", "loud"},
		{"extra"},
		{"-no-such-flag"},
	} {
		if _, err := simFlags(args); !errors.Is(err, errUsage) {
			t.Errorf("%q: %v, want a usage error", args, err)
		}
	}
}

func TestProgressBar(t *testing.T) {
	var b bytes.Buffer
	bar := newProgressBar(&b, "bar")
	bar.update(sim.Progress{Requests: 10, Done: 5, HitRate: 0.5})
	bar.done()
	out := b.String()
	if !strings.HasPrefix(out, "\r[###############...............] 5/10 requests") || !strings.HasSuffix(out, "\n") {
		t.Fatalf("bar %q", out)
	}
	b.Reset()
	log := newProgressBar(&b, "auto") // a buffer is not a terminal
	log.update(sim.Progress{Requests: 10, Done: 10})
	log.done()
	if out := b.String(); !strings.HasPrefix(out, "sim: 10/10 requests") || strings.Count(out, "\n") != 1 {
		t.Fatalf("log %q", out)
	}
	b.Reset()
	off := newProgressBar(&b, "off")
	off.update(sim.Progress{Requests: 1})
	off.done()
	if b.Len() != 0 {
		t.Fatalf("off wrote %q", b.String())
	}
}

// TestSimFlagsReuseAndStore: the seed preset reuses preempted blocks at
// once, other presets pin them, -reuse-preempted overrides either way, and
// the store URL comes from -redis or KVMESH_REDIS_URL.
func TestSimFlagsReuseAndStore(t *testing.T) {
	quiet(t)
	t.Setenv("KVMESH_REDIS_URL", "redis://127.0.0.1:1/0")
	for _, tc := range []struct {
		args     []string
		reuse    bool
		redisURL string
	}{
		{args: nil, reuse: true, redisURL: "redis://127.0.0.1:1/0"},
		{args: []string{"-reuse-preempted=false"}, reuse: false, redisURL: "redis://127.0.0.1:1/0"},
		{args: []string{"-preset", "smoke"}, reuse: false, redisURL: "redis://127.0.0.1:1/0"},
		{args: []string{"-preset", "smoke", "-reuse-preempted", "-redis", ""}, reuse: true, redisURL: ""},
	} {
		o, err := simFlags(tc.args)
		if err != nil {
			t.Fatalf("%q: %v", tc.args, err)
		}
		if o.cfg.ReusePreempted != tc.reuse || o.cfg.RedisURL != tc.redisURL {
			t.Errorf("%q: reuse %v, redis %q; want %v, %q", tc.args, o.cfg.ReusePreempted, o.cfg.RedisURL, tc.reuse, tc.redisURL)
		}
	}
}
