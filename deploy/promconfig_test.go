package deploy_test

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"gopkg.in/yaml.v3"

	"github.com/kvmesh/kvmesh/deploy"
)

// TestRetargetPrometheus: every target of deploy/prometheus.yml is replaced
// and counted, the intervals are the test's, and a target the caller does
// not serve is refused by name.
func TestRetargetPrometheus(t *testing.T) {
	data, err := os.ReadFile(filepath.Join("..", deploy.PrometheusFile))
	if err != nil {
		t.Fatal(err)
	}
	served := map[string]bool{}
	out, n, err := deploy.RetargetPrometheus(data, "2s", func(host string) (string, bool) {
		served[host] = true
		return "127.0.0.1:1" + host[:1], true
	})
	if err != nil {
		t.Fatal(err)
	}
	if n != len(served) || n < 5 {
		t.Fatalf("%d targets counted, %d hosts asked for: want one per target, at least 5", n, len(served))
	}
	var cfg struct {
		Global        map[string]string `yaml:"global"`
		ScrapeConfigs []struct {
			Interval      string `yaml:"scrape_interval"`
			StaticConfigs []struct {
				Targets []string `yaml:"targets"`
			} `yaml:"static_configs"`
		} `yaml:"scrape_configs"`
	}
	if err := yaml.Unmarshal(out, &cfg); err != nil {
		t.Fatal(err)
	}
	if cfg.Global["scrape_interval"] != "2s" || cfg.Global["evaluation_interval"] != "2s" {
		t.Errorf("global %v: want 2s intervals", cfg.Global)
	}
	for _, sc := range cfg.ScrapeConfigs {
		if sc.Interval != "" {
			t.Errorf("a job keeps its own interval %q", sc.Interval)
		}
		for _, st := range sc.StaticConfigs {
			for _, tg := range st.Targets {
				if !strings.HasPrefix(tg, "127.0.0.1:1") {
					t.Errorf("target %q not replaced", tg)
				}
			}
		}
	}
	_, _, err = deploy.RetargetPrometheus(data, "1s", func(host string) (string, bool) { return "x:1", host != "sender" })
	if !errors.Is(err, deploy.ErrUnknownTarget) || !strings.Contains(err.Error(), "sender") {
		t.Fatalf("an unserved target: %v, want ErrUnknownTarget naming sender", err)
	}
}
