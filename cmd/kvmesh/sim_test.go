package main

import (
	"bytes"
	"errors"
	"io"
	"slices"
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
	seed, _ := sim.LookupPreset("seed")
	if !o.cfg.PD || o.cfg.Workload != seed.Workload || o.cfg.Engine != seed.Engine || o.cfg.Model.Name != "hybrid-mla-linear" {
		t.Fatalf("seed preset not applied: %+v", o.cfg)
	}
	if strings.Join(o.cfg.Brokers, ",") != "10.0.0.1:9092,10.0.0.2:9092" {
		t.Fatalf("brokers %v", o.cfg.Brokers)
	}
	if o.cfg.RunTag == "" || o.cfg.Salt != o.cfg.RunTag {
		t.Fatalf("run tag %q, salt %q: -fresh salts with the run tag", o.cfg.RunTag, o.cfg.Salt)
	}
	want := []sim.Pair{{Decode: sim.Endpoint{WorkerURL: "http://127.0.0.1:8084"}, Prefill: sim.Endpoint{WorkerURL: "http://127.0.0.1:8085"}}}
	if !slices.Equal(o.cfg.LookupURLs, []string{"http://127.0.0.1:8081"}) || !slices.Equal(o.cfg.SchedulerURLs, []string{"http://127.0.0.1:8082"}) ||
		!slices.Equal(o.cfg.SenderURLs, []string{"http://127.0.0.1:8083"}) || !slices.Equal(o.cfg.Fleet, want) {
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
	smoke, _ := sim.LookupPreset("smoke")
	if w.Requests != 5 || w.Turns != (sim.Range{Min: 1, Max: 2}) || w.UserTokens != smoke.Workload.UserTokens {
		t.Fatalf("workload %+v", w)
	}
	if !o.cfg.PD || o.cfg.Engine.PoolBlocks != 9 || o.cfg.Model.Name != "full-swa-mamba" || !o.json {
		t.Fatalf("config %+v", o.cfg)
	}
	if o.cfg.RunTag != "x" || o.cfg.Salt != "" || len(o.cfg.SchedulerURLs) != 0 || o.cfg.SchedulerURL != "" {
		t.Fatalf("run tag %q salt %q scheduler %q", o.cfg.RunTag, o.cfg.Salt, o.cfg.SchedulerURLs)
	}
}

// TestSimFlagsReplicas: -lookup, -scheduler and -sender take the
// comma-separated base URLs of a service's replicas.
func TestSimFlagsReplicas(t *testing.T) {
	quiet(t)
	o, err := simFlags([]string{"-lookup", "http://l1:1, http://l2:2", "-scheduler", "http://s1:1,http://s2:2,http://s3:3", "-sender", "http://x:1"})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(o.cfg.LookupURLs, []string{"http://l1:1", "http://l2:2"}) ||
		!slices.Equal(o.cfg.SchedulerURLs, []string{"http://s1:1", "http://s2:2", "http://s3:3"}) ||
		!slices.Equal(o.cfg.SenderURLs, []string{"http://x:1"}) {
		t.Fatalf("replicas: lookup %q scheduler %q sender %q", o.cfg.LookupURLs, o.cfg.SchedulerURLs, o.cfg.SenderURLs)
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
		{"-engines", "0"},
		{"-engines", "3", "-worker", "http://a:1,http://b:2"},
		{"-engines", "2", "-worker", "http://host-without-port"},
		{"-engines", "2", "-engine", "only-one"},
		{"-engines", "2", "-pd", "-prefill-engine", "p0,p1,p2"},
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

// TestSimFlagsFleet: -engines N builds N pairs; one worker URL stands for
// stack.sh's layout (engine i at the port + 2i, decode and prefill), a list
// names every worker; engine ids come one per engine; without -pd the
// pairs have no prefill engine.
func TestSimFlagsFleet(t *testing.T) {
	quiet(t)
	o, err := simFlags([]string{"-engines", "3"})
	if err != nil {
		t.Fatal(err)
	}
	want := []sim.Pair{
		{Decode: sim.Endpoint{WorkerURL: "http://127.0.0.1:8084"}, Prefill: sim.Endpoint{WorkerURL: "http://127.0.0.1:8085"}},
		{Decode: sim.Endpoint{WorkerURL: "http://127.0.0.1:8086"}, Prefill: sim.Endpoint{WorkerURL: "http://127.0.0.1:8087"}},
		{Decode: sim.Endpoint{WorkerURL: "http://127.0.0.1:8088"}, Prefill: sim.Endpoint{WorkerURL: "http://127.0.0.1:8089"}},
	}
	if !slices.Equal(o.cfg.Fleet, want) {
		t.Fatalf("seed preset, 3 engines: fleet %+v, want %+v", o.cfg.Fleet, want)
	}
	o, err = simFlags([]string{"-preset", "smoke", "-engines", "2", "-worker", "http://w0:9000, http://w1:9100", "-engine", "a,b"})
	if err != nil {
		t.Fatal(err)
	}
	want = []sim.Pair{{Decode: sim.Endpoint{EngineID: "a", WorkerURL: "http://w0:9000"}}, {Decode: sim.Endpoint{EngineID: "b", WorkerURL: "http://w1:9100"}}}
	if !slices.Equal(o.cfg.Fleet, want) {
		t.Fatalf("listed workers: fleet %+v, want %+v", o.cfg.Fleet, want)
	}
}

// TestSimFlagsLongContext: the long-context preset is chunked prefill over
// 8K-32K-token prompts on one engine with a pool that holds the longest.
func TestSimFlagsLongContext(t *testing.T) {
	quiet(t)
	o, err := simFlags([]string{"-preset", "long-context"})
	if err != nil {
		t.Fatal(err)
	}
	w, e := o.cfg.Workload, o.cfg.Engine
	if o.cfg.PD || len(o.cfg.Fleet) != 1 || o.cfg.Model.Name != "hybrid-mla-linear" {
		t.Fatalf("config %+v", o.cfg)
	}
	if w.SystemTokens.Min+w.UserTokens.Min < sim.LongContextMinPrompt || e.MaxBatchTokens >= sim.LongContextMaxPrompt ||
		e.PoolBlocks*16 < sim.LongContextMaxPrompt {
		t.Fatalf("workload %+v, engine %+v: want 8K+ prompts, a step budget below 32K (chunked prefill) and a pool that holds 32K", w, e)
	}
	if !strings.Contains(presetList(), "long-context (") {
		t.Fatalf("preset list %q lacks long-context", presetList())
	}
}
