package main

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/internal/sim"
	"github.com/kvmesh/kvmesh/pkg/bus"
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
	if !o.cfg.PD || o.cfg.Workload != seed.Workload || o.cfg.Engine != seed.Engine || o.cfg.Model.Name != "hybrid-mla-linear" || o.cfg.Model.WorldSize() != 8 {
		t.Fatalf("seed preset not applied: %+v", o.cfg)
	}
	if strings.Join(o.cfg.Brokers, ",") != "10.0.0.1:9092,10.0.0.2:9092" {
		t.Fatalf("brokers %v", o.cfg.Brokers)
	}
	if o.cfg.RunTag == "" || o.cfg.Salt != o.cfg.RunTag {
		t.Fatalf("run tag %q, salt %q: -fresh salts with the run tag", o.cfg.RunTag, o.cfg.Salt)
	}
	want := []sim.Pair{{Decode: sim.Endpoint{WorkerURLs: ports(8084, 8)}, Prefill: sim.Endpoint{WorkerURLs: ports(8092, 8)}}}
	if !slices.Equal(o.cfg.LookupURLs, []string{"http://127.0.0.1:8081"}) || !slices.Equal(o.cfg.SchedulerURLs, []string{"http://127.0.0.1:8082"}) ||
		!slices.Equal(o.cfg.SenderURLs, []string{"http://127.0.0.1:8083"}) || !reflect.DeepEqual(o.cfg.Fleet, want) {
		t.Fatalf("addresses %+v", o.cfg)
	}
}

// ports lists n loopback base URLs from port on.
func ports(port, n int) []string {
	var out []string
	for i := range n {
		out = append(out, fmt.Sprintf("http://127.0.0.1:%d", port+i))
	}
	return out
}

func TestSimFlagsOverride(t *testing.T) {
	quiet(t)
	o, err := simFlags([]string{"-preset", "smoke", "-requests", "5", "-turns", "1-2", "-pd", "-pool-blocks", "9",
		"-model", "full-swa-mamba", "-fresh=false", "-run-tag", "x", "-json", "-scheduler", "", "-rank-timeout", "5s"})
	if err != nil {
		t.Fatal(err)
	}
	w := o.cfg.Workload
	smoke, _ := sim.LookupPreset("smoke")
	if w.Requests != 5 || w.Turns != (sim.Range{Min: 1, Max: 2}) || w.UserTokens != smoke.Workload.UserTokens {
		t.Fatalf("workload %+v", w)
	}
	if !o.cfg.PD || o.cfg.Engine.PoolBlocks != 9 || o.cfg.Model.Name != "full-swa-mamba" || !o.json || o.cfg.RankTimeout != 5*time.Second {
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
		{"-tp", "2", "-worker", "http://a:1,http://b:2,http://c:3"},
		{"-tp", "2", "-prefill-worker", "http://a:1,http://b:2,http://c:3"},
		{"-worker", "http://host-without-port"},
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
	log.update(sim.Progress{Requests: 10, Done: 3, DeadRanks: 1})
	if out := b.String(); !strings.Contains(out, "1 DEAD RANKS") {
		t.Fatalf("log with a dead rank %q", out)
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
// stack.sh's layout (with one rank per engine, engine i at the port + 2i,
// decode and prefill), a list names every worker; engine ids come one per
// engine; without -pd the pairs have no prefill engine.
func TestSimFlagsFleet(t *testing.T) {
	quiet(t)
	o, err := simFlags([]string{"-engines", "3", "-tp", "1"})
	if err != nil {
		t.Fatal(err)
	}
	want := []sim.Pair{
		{Decode: sim.Endpoint{WorkerURLs: ports(8084, 1)}, Prefill: sim.Endpoint{WorkerURLs: ports(8085, 1)}},
		{Decode: sim.Endpoint{WorkerURLs: ports(8086, 1)}, Prefill: sim.Endpoint{WorkerURLs: ports(8087, 1)}},
		{Decode: sim.Endpoint{WorkerURLs: ports(8088, 1)}, Prefill: sim.Endpoint{WorkerURLs: ports(8089, 1)}},
	}
	if !reflect.DeepEqual(o.cfg.Fleet, want) {
		t.Fatalf("seed preset at TP1, 3 engines: fleet %+v, want %+v", o.cfg.Fleet, want)
	}
	o, err = simFlags([]string{"-preset", "smoke", "-engines", "2", "-worker", "http://w0:9000, http://w1:9100", "-engine", "a,b"})
	if err != nil {
		t.Fatal(err)
	}
	want = []sim.Pair{{Decode: sim.Endpoint{EngineID: "a", WorkerURLs: []string{"http://w0:9000"}}}, {Decode: sim.Endpoint{EngineID: "b", WorkerURLs: []string{"http://w1:9100"}}}}
	if !reflect.DeepEqual(o.cfg.Fleet, want) {
		t.Fatalf("listed workers: fleet %+v, want %+v", o.cfg.Fleet, want)
	}
}

// TestSimFlagsRankLayout: with W ranks per engine one -worker URL stands
// for stack.sh's layout (decode engine i's rank k at the port + 2·i·W + k,
// prefill engine i's at the port + (2i+1)·W + k), one -prefill-worker URL
// anchors the prefill engines alone (+ 2·i·W + k), and lists name N×W
// workers engine by engine.
func TestSimFlagsRankLayout(t *testing.T) {
	quiet(t)
	for _, tc := range []struct {
		name string
		args []string
		want []sim.Pair
	}{
		{"seed: TP8 1P1D", nil, []sim.Pair{{Decode: sim.Endpoint{WorkerURLs: ports(8084, 8)}, Prefill: sim.Endpoint{WorkerURLs: ports(8092, 8)}}}},
		{"TP1 1P1D: today's layout", []string{"-tp", "1"}, []sim.Pair{{Decode: sim.Endpoint{WorkerURLs: ports(8084, 1)}, Prefill: sim.Endpoint{WorkerURLs: ports(8085, 1)}}}},
		{"TP1, listed decode worker", []string{"-model", "hybrid-mla-linear", "-worker", "http://127.0.0.1:7000"}, []sim.Pair{
			{Decode: sim.Endpoint{WorkerURLs: ports(7000, 1)}, Prefill: sim.Endpoint{WorkerURLs: ports(7001, 1)}},
		}},
		{"TP2, two pairs", []string{"-tp", "2", "-engines", "2", "-worker", "http://127.0.0.1:7000"}, []sim.Pair{
			{Decode: sim.Endpoint{WorkerURLs: ports(7000, 2)}, Prefill: sim.Endpoint{WorkerURLs: ports(7002, 2)}},
			{Decode: sim.Endpoint{WorkerURLs: ports(7004, 2)}, Prefill: sim.Endpoint{WorkerURLs: ports(7006, 2)}},
		}},
		{"TP2, prefill anchor", []string{"-tp", "2", "-engines", "2", "-worker", "http://127.0.0.1:7000", "-prefill-worker", "http://127.0.0.1:9000"}, []sim.Pair{
			{Decode: sim.Endpoint{WorkerURLs: ports(7000, 2)}, Prefill: sim.Endpoint{WorkerURLs: ports(9000, 2)}},
			{Decode: sim.Endpoint{WorkerURLs: ports(7004, 2)}, Prefill: sim.Endpoint{WorkerURLs: ports(9004, 2)}},
		}},
		{"TP2, lists", []string{"-tp", "2", "-worker", "http://a:1,http://b:2", "-prefill-worker", "http://c:3, http://d:4"}, []sim.Pair{
			{Decode: sim.Endpoint{WorkerURLs: []string{"http://a:1", "http://b:2"}}, Prefill: sim.Endpoint{WorkerURLs: []string{"http://c:3", "http://d:4"}}},
		}},
		{"TP2, decode list, derived prefill", []string{"-tp", "2", "-worker", "http://127.0.0.1:7000,http://127.0.0.1:7001"}, []sim.Pair{
			{Decode: sim.Endpoint{WorkerURLs: ports(7000, 2)}, Prefill: sim.Endpoint{WorkerURLs: ports(7002, 2)}},
		}},
		{"TP2 PP2 without pd", []string{"-preset", "smoke", "-tp", "2", "-pp", "2", "-worker", "http://127.0.0.1:7000"}, []sim.Pair{
			{Decode: sim.Endpoint{WorkerURLs: ports(7000, 4)}},
		}},
	} {
		o, err := simFlags(tc.args)
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if !reflect.DeepEqual(o.cfg.Fleet, tc.want) {
			t.Errorf("%s: fleet %+v, want %+v", tc.name, o.cfg.Fleet, tc.want)
		}
	}
}

// TestSimFlagsParallel: -tp/-pcp/-dcp/-pp override the model's layout (the
// seed's TP8 by default), and a layout vLLM refuses is a usage error.
func TestSimFlagsParallel(t *testing.T) {
	quiet(t)
	for _, tc := range []struct {
		args  []string
		world int
		tp    int
	}{
		{nil, 8, 8},
		{[]string{"-tp", "2"}, 2, 2},
		{[]string{"-preset", "smoke"}, 1, 1},
		{[]string{"-preset", "smoke", "-tp", "4", "-pp", "2", "-worker", "http://127.0.0.1:7000"}, 8, 4},
	} {
		o, err := simFlags(tc.args)
		if err != nil {
			t.Fatalf("%q: %v", tc.args, err)
		}
		if o.cfg.Model.WorldSize() != tc.world || max(1, o.cfg.Model.Parallel.TP) != tc.tp {
			t.Errorf("%q: world %d, tp %d; want %d, %d", tc.args, o.cfg.Model.WorldSize(), o.cfg.Model.Parallel.TP, tc.world, tc.tp)
		}
	}
	for _, args := range [][]string{
		{"-tp", "-1"},
		{"-tp", "4", "-dcp", "3"}, // DCP must divide TP
		{"-pcp", "2"},             // context parallelism with a hybrid model
	} {
		if _, err := simFlags(args); !errors.Is(err, errUsage) {
			t.Errorf("%q: %v, want a usage error", args, err)
		}
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
	if o.cfg.PD || len(o.cfg.Fleet) != 1 || o.cfg.Model.Name != "hybrid-mla-linear" || o.cfg.Model.WorldSize() != 1 {
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

func TestSimFlagsKafkaSecurity(t *testing.T) {
	quiet(t)
	dir := t.TempDir()
	pwFile := dir + "/kafka-password"
	if err := os.WriteFile(pwFile, []byte("sim-secret\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Setenv("KVMESH_KAFKA_SASL_MECHANISM", "scram-sha-512")
	t.Setenv("KVMESH_KAFKA_SASL_USERNAME", "kvmesh")
	t.Setenv("KVMESH_KAFKA_SASL_PASSWORD_FILE", pwFile)
	o, err := simFlags(nil)
	if err != nil {
		t.Fatal(err)
	}
	want := bus.Security{SASLMechanism: bus.SASLScramSHA512, SASLUsername: "kvmesh", SASLPassword: "sim-secret"}
	if o.cfg.Kafka != want {
		t.Fatalf("Kafka security %v, want %v", o.cfg.Kafka, want)
	}

	t.Setenv("KVMESH_KAFKA_SASL_MECHANISM", "kerberos")
	if _, err := simFlags(nil); !errors.Is(err, errUsage) || !strings.Contains(err.Error(), "KVMESH_KAFKA_SASL_MECHANISM") {
		t.Fatalf("simFlags with an unknown mechanism = %v, want a usage error naming the variable", err)
	}
}

// TestSimFlagsTenants: -tenants and -tenant-prefix set the workload's
// tenants; without them the preset's workload has none.
func TestSimFlagsTenants(t *testing.T) {
	quiet(t)
	o, err := simFlags([]string{"-preset", "smoke", "-tenants", "3", "-tenant-prefix", "acme-"})
	if err != nil {
		t.Fatal(err)
	}
	if w := o.cfg.Workload; w.Tenants != 3 || w.TenantPrefix != "acme-" {
		t.Fatalf("workload tenants %d prefix %q, want 3 acme-", w.Tenants, w.TenantPrefix)
	}
	o, err = simFlags([]string{"-preset", "seed"})
	if err != nil {
		t.Fatal(err)
	}
	if w := o.cfg.Workload; w.Tenants != 0 || w.TenantPrefix != "" {
		t.Fatalf("seed workload tenants %d prefix %q, want none", w.Tenants, w.TenantPrefix)
	}
}

// TestSimFlagsAlso: each -also adds a run of another model with its
// gpuworkers, its own run tag and the main run's salt and workload; a
// malformed value, a URL count that is not the model's worker ranks and
// -pd are usage errors.
func TestSimFlagsAlso(t *testing.T) {
	quiet(t)
	o, err := simFlags([]string{"-preset", "smoke", "-run-tag", "sim-abc",
		"-also", "full-swa-mamba=http://w1:8084", "-also", "dense=http://w2:8084"})
	if err != nil {
		t.Fatal(err)
	}
	if len(o.more) != 2 {
		t.Fatalf("%d more runs, want 2", len(o.more))
	}
	for i, want := range []string{"full-swa-mamba", "dense-8b"} {
		c := o.more[i]
		if c.Model.Name != want || c.RunTag == o.cfg.RunTag || c.Salt != o.cfg.Salt || c.Workload.Requests != o.cfg.Workload.Requests ||
			len(c.Fleet) != 1 || len(c.Fleet[0].Decode.WorkerURLs) != 1 {
			t.Fatalf("run %d: model %s tag %s salt %s fleet %+v; want %s, its own tag, the main salt", i, c.Model.Name, c.RunTag, c.Salt, c.Fleet, want)
		}
	}
	for _, args := range [][]string{
		{"-also", "dense"},
		{"-also", "=http://w:1"},
		{"-also", "llama=http://w:1"},
		{"-also", "hybrid-mla-linear-tp8=http://w:1"},
		{"-pd", "-also", "dense=http://w:1"},
	} {
		if _, err := simFlags(append([]string{"-preset", "smoke"}, args...)); !errors.Is(err, errUsage) {
			t.Errorf("%v: %v, want a usage error", args, err)
		}
	}
}
