package sim

import (
	"context"
	"errors"
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
		"several ranks":      func(c *Config) { c.Model = tp2 },
		"bad workload":       func(c *Config) { c.Workload.Requests = 0 },
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
