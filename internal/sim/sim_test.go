package sim

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"

	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

func TestRunRefusesBadConfig(t *testing.T) {
	valid := func() Config {
		m, _ := kvcore.Preset("hybrid-mla-linear")
		return Config{
			Model: m, Workload: testWorkload(), Brokers: []string{"127.0.0.1:1"},
			Engine:    EngineConfig{MaxBatchTokens: 64, MaxRunning: 2},
			LookupURL: "http://127.0.0.1:1", Decode: Endpoint{WorkerURL: "http://127.0.0.1:1"},
		}
	}
	tp2 := &kvcore.Model{Name: "tp2", HashBlockSize: 16, Parallel: kvcore.Parallel{TP: 2},
		Groups: []kvcore.Group{{Kind: kvcore.KindFullAttention, BlockSize: 16, BytesPerBlock: 64}}}
	for name, mutate := range map[string]func(*Config){
		"no model":           func(c *Config) { c.Model = nil },
		"no lookup":          func(c *Config) { c.LookupURL = "" },
		"no worker":          func(c *Config) { c.Decode.WorkerURL = "" },
		"pd without prefill": func(c *Config) { c.PD = true },
		"no brokers":         func(c *Config) { c.Brokers = nil },
		"no step budget":     func(c *Config) { c.Engine.MaxBatchTokens = 0 },
		"one URL, two ranks": func(c *Config) { c.Model = tp2 },
		"bad workload":       func(c *Config) { c.Workload.Requests = 0 },
		"fleet and decode":   func(c *Config) { c.Fleet = []Pair{{Decode: Endpoint{WorkerURL: "http://127.0.0.1:2"}}} },
		"fleet engine without worker": func(c *Config) {
			c.Decode = Endpoint{}
			c.Fleet = []Pair{{Decode: Endpoint{WorkerURL: "http://127.0.0.1:2"}}, {Decode: Endpoint{EngineID: "x"}}}
		},
		"fleet pd without prefill": func(c *Config) {
			c.Decode, c.PD = Endpoint{}, true
			c.Fleet = []Pair{{Decode: Endpoint{WorkerURL: "http://127.0.0.1:2"}, Prefill: Endpoint{WorkerURL: "http://127.0.0.1:3"}}, {Decode: Endpoint{WorkerURL: "http://127.0.0.1:4"}}}
		},
	} {
		c := valid()
		mutate(&c)
		_, err := Run(context.Background(), c)
		if !errors.Is(err, ErrConfig) && !errors.Is(err, ErrWorkload) {
			t.Errorf("%s: Run = %v, want ErrConfig or ErrWorkload", name, err)
		}
	}
	// A valid config fails only when it reaches the (absent) gpuworker.
	if _, err := Run(context.Background(), valid()); err == nil || errors.Is(err, ErrConfig) {
		t.Fatalf("valid config: %v; want a connection error", err)
	}
}

// fakeWorker serves GET /v1/pool for engine id of model m.
func fakeWorker(t *testing.T, m *kvcore.Model, id string) string {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(map[string]any{
			"engine_id": id, "model": m.Name, "fingerprint": m.Fingerprint(),
			"groups": []map[string]int{{"blocks": 64}, {"blocks": 64}},
		})
	}))
	t.Cleanup(srv.Close)
	return srv.URL
}

// TestFleetWorkers: every engine of a fleet takes its id from its own
// gpuworker, and two engines on workers of one engine id are refused (a
// gpuworker serves one engine).
func TestFleetWorkers(t *testing.T) {
	m, _ := kvcore.Preset("hybrid-mla-linear")
	cfg := Config{
		Model: m, Workload: testWorkload(), Brokers: []string{"127.0.0.1:1"}, LookupURL: "http://127.0.0.1:1",
		Engine: EngineConfig{MaxBatchTokens: 64, MaxRunning: 2, Watermark: 1}, PD: true,
		Fleet: []Pair{
			{Decode: Endpoint{WorkerURL: fakeWorker(t, m, "decode-0")}, Prefill: Endpoint{WorkerURL: fakeWorker(t, m, "prefill-0")}},
			{Decode: Endpoint{WorkerURL: fakeWorker(t, m, "decode-1")}, Prefill: Endpoint{WorkerURL: fakeWorker(t, m, "prefill-1")}},
		},
	}
	c := cfg
	if err := c.defaults(); err != nil {
		t.Fatal(err)
	}
	if err := c.workers(context.Background()); err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, p := range c.Fleet {
		ids = append(ids, p.Decode.EngineID, p.Prefill.EngineID)
	}
	if !slices.Equal(ids, []string{"decode-0", "prefill-0", "decode-1", "prefill-1"}) || c.Engine.PoolBlocks != 64 {
		t.Fatalf("engine ids %v, pool %d", ids, c.Engine.PoolBlocks)
	}
	if cfg.Fleet[0].Decode.EngineID != "" {
		t.Fatal("filling in the engine ids changed the caller's fleet")
	}
	cfg.Fleet[1].Prefill.WorkerURL = cfg.Fleet[0].Decode.WorkerURL
	if _, err := Run(context.Background(), cfg); !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), "decode-0") {
		t.Fatalf("two engines on one gpuworker: %v, want ErrConfig naming decode-0", err)
	}
}
