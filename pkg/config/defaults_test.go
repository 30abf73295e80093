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
	Addr    string        `env:"V_ADDR" doc:"listen address"`
}

func (s *SharedValueDefaults) SetDefaults() {
	s.Timeout = libraryTimeout
	s.Addr = ":1"
}

type valueDefaults struct {
	SharedValueDefaults
	Chain   []string `env:"V_CHAIN" doc:"chain"`
	Limit   int64    `env:"V_LIMIT" doc:"limit"`
	Tagged  int      `env:"V_TAGGED"`
	NoValue string   `env:"V_NONE"`
}

// SetDefaults runs after the embedded struct's, so it overrides V_ADDR's.
func (v *valueDefaults) SetDefaults() {
	v.Chain = libraryChain
	v.Limit = 4 << 20
	v.Tagged = 7
	v.Addr = ":2"
}

func TestLoadValueDefaults(t *testing.T) {
	var got valueDefaults
	if err := config.Load(&got, lookupFrom(nil)); err != nil {
		t.Fatalf("Load: %v", err)
	}
	if got.Timeout != libraryTimeout || strings.Join(got.Chain, ",") != "store,pd" || got.Limit != 4<<20 ||
		got.Tagged != 7 || got.NoValue != "" || got.Addr != ":2" {
		t.Fatalf("Load value defaults: %+v", got)
	}
	got.Chain[0] = "changed"
	if libraryChain[0] != "store" {
		t.Fatal("Load shared the default slice with the loaded value")
	}
	if err := config.Load(&got, lookupFrom(map[string]string{"V_TIMEOUT": "3s"})); err != nil || got.Timeout != 3*time.Second {
		t.Fatalf("Load with V_TIMEOUT=3s: %v, timeout %s", err, got.Timeout)
	}
}

func TestDefaults(t *testing.T) {
	got := config.Defaults[valueDefaults]()
	if got.Timeout != libraryTimeout || got.Addr != ":2" || got.Tagged != 7 || got.Limit != 4<<20 {
		t.Fatalf("Defaults: %+v", got)
	}
	if shared := config.Defaults[SharedValueDefaults](); shared.Addr != ":1" {
		t.Fatalf("Defaults of the embedded struct: %+v", shared)
	}
}

func TestDescribeValueDefaults(t *testing.T) {
	want := map[string]string{"V_TIMEOUT": "250ms", "V_ADDR": ":2", "V_CHAIN": "store,pd", "V_LIMIT": "4194304", "V_TAGGED": "7", "V_NONE": ""}
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

type requiredURL struct {
	URL  string `env:"V_URL" required:"true"`
	Name string `env:"V_NAME"`
}

func (r *requiredURL) SetDefaults() { r.Name = "n" }

// TestOverlay: Overlay sets only the variables given, keeping the other
// fields (no defaults, no required settings).
func TestOverlay(t *testing.T) {
	var r requiredURL
	if err := config.Load(&r, lookupFrom(nil)); !errors.Is(err, config.ErrMissing) {
		t.Fatalf("Load = %v, want ErrMissing", err)
	}
	r = requiredURL{Name: "kept"}
	if err := config.Overlay(&r, lookupFrom(nil)); err != nil || r.URL != "" || r.Name != "kept" {
		t.Fatalf("Overlay = %v, %+v", err, r)
	}
	if err := config.Overlay(&r, lookupFrom(map[string]string{"V_URL": "u", "V_NAME": ""})); err != nil || r.URL != "u" || r.Name != "kept" {
		t.Fatalf("Overlay with V_URL = %v, %+v", err, r)
	}
	if err := config.Overlay(r, lookupFrom(nil)); !errors.Is(err, config.ErrNotStructPointer) {
		t.Errorf("Overlay(non-pointer) = %v, want ErrNotStructPointer", err)
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
