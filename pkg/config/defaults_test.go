package config_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/pkg/config"
)

// libraryTimeout and libraryChain stand for a library's Default constants.
const libraryTimeout = 250 * time.Millisecond

var libraryChain = []string{"store", "pd"}

type SharedValueDefaults struct {
	Timeout time.Duration `env:"V_TIMEOUT" doc:"library timeout"`
}

func (*SharedValueDefaults) ConfigDefaults() map[string]any {
	return map[string]any{"V_TIMEOUT": libraryTimeout}
}

type valueDefaults struct {
	SharedValueDefaults
	Chain   []string `env:"V_CHAIN" doc:"chain"`
	Limit   int64    `env:"V_LIMIT" doc:"limit"`
	Tagged  int      `env:"V_TAGGED" default:"7"`
	NoValue string   `env:"V_NONE"`
}

func (*valueDefaults) ConfigDefaults() map[string]any {
	return map[string]any{"V_CHAIN": libraryChain, "V_LIMIT": 4 << 20}
}

func TestLoadValueDefaults(t *testing.T) {
	var got valueDefaults
	if err := config.Load(&got, lookupFrom(nil)); err != nil {
		t.Fatalf("Load: %v", err)
	}
	if got.Timeout != libraryTimeout || strings.Join(got.Chain, ",") != "store,pd" || got.Limit != 4<<20 ||
		got.Tagged != 7 || got.NoValue != "" {
		t.Fatalf("Load value defaults: %+v", got)
	}
	if err := config.Load(&got, lookupFrom(map[string]string{"V_TIMEOUT": "3s"})); err != nil || got.Timeout != 3*time.Second {
		t.Fatalf("Load with V_TIMEOUT=3s: %v, timeout %s", err, got.Timeout)
	}
}

func TestDescribeValueDefaults(t *testing.T) {
	want := map[string]string{"V_TIMEOUT": "250ms", "V_CHAIN": "store,pd", "V_LIMIT": "4194304", "V_TAGGED": "7", "V_NONE": ""}
	for _, f := range config.Describe(valueDefaults{}) {
		if f.Default != want[f.Env] {
			t.Errorf("%s: default %q, want %q", f.Env, f.Default, want[f.Env])
		}
	}
	table := config.MarkdownTable(&valueDefaults{})
	if !strings.Contains(table, "| `V_TIMEOUT` | duration | `250ms` | library timeout |") {
		t.Errorf("table lacks the value default:\n%s", table)
	}
}

type twiceStated struct {
	Timeout time.Duration `env:"V_TIMEOUT" default:"1s"`
}

func (*twiceStated) ConfigDefaults() map[string]any {
	return map[string]any{"V_TIMEOUT": time.Second}
}

type unknownDefault struct {
	Timeout time.Duration `env:"V_TIMEOUT"`
}

func (*unknownDefault) ConfigDefaults() map[string]any {
	return map[string]any{"V_TIMEUOT": time.Second}
}

func TestLoadRejectsBadValueDefaults(t *testing.T) {
	for name, dst := range map[string]any{"stated twice": &twiceStated{}, "no such setting": &unknownDefault{}} {
		if err := config.Load(dst, lookupFrom(nil)); !errors.Is(err, config.ErrDefault) {
			t.Errorf("%s: Load = %v, want ErrDefault", name, err)
		}
	}
}

func TestFillZero(t *testing.T) {
	cfg := valueDefaults{Chain: []string{"pd"}}
	if err := config.FillZero(&cfg, "V_TIMEOUT", "V_CHAIN", "V_TAGGED"); err != nil {
		t.Fatalf("FillZero: %v", err)
	}
	if cfg.Timeout != libraryTimeout || strings.Join(cfg.Chain, ",") != "pd" || cfg.Tagged != 7 || cfg.Limit != 0 {
		t.Fatalf("FillZero filled %+v; want the zero timeout and tagged defaulted, the set chain and the unnamed limit kept", cfg)
	}
	for _, name := range []string{"V_NONE", "V_MISSING"} {
		if err := config.FillZero(&cfg, name); !errors.Is(err, config.ErrDefault) {
			t.Errorf("FillZero(%s) = %v, want ErrDefault", name, err)
		}
	}
	if err := config.FillZero(cfg); !errors.Is(err, config.ErrNotStructPointer) {
		t.Errorf("FillZero(non-pointer) = %v, want ErrNotStructPointer", err)
	}
}
