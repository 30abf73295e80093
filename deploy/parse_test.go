package deploy_test

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/kvmesh/kvmesh/deploy"
)

func TestInterpolate(t *testing.T) {
	env := map[string]string{"SET": "v", "EMPTY": ""}
	lookup := func(k string) (string, bool) { v, ok := env[k]; return v, ok }
	for _, tc := range []struct {
		in, want string
		err      error
	}{
		{in: "plain", want: "plain"},
		{in: "${SET}", want: "v"},
		{in: "$SET/x", want: "v/x"},
		{in: "${UNSET}", want: ""},
		{in: "${UNSET:-def}", want: "def"},
		{in: "${EMPTY:-def}", want: "def"},
		{in: "${EMPTY-def}", want: ""},
		{in: "${UNSET-def}", want: "def"},
		{in: "${SET:-def}", want: "v"},
		{in: "${UNSET:-${SET}}", want: "v"},
		{in: "${UNSET:-}", want: ""},
		{in: "$$SET costs $$5", want: "$SET costs $5"},
		{in: "a $ b", want: "a $ b"},
		{in: "${SET:?need it}", want: "v"},
		{in: "${EMPTY:?need it}", err: deploy.ErrInterpolation},
		{in: "${UNSET?need it}", err: deploy.ErrInterpolation},
		{in: "${EMPTY?need it}", want: ""},
		{in: "${unclosed", err: deploy.ErrSyntax},
	} {
		got, err := deploy.Interpolate(tc.in, lookup)
		if !errors.Is(err, tc.err) || err == nil && got != tc.want {
			t.Errorf("Interpolate(%q) = %q, %v; want %q, %v", tc.in, got, err, tc.want, tc.err)
		}
	}
}

func TestMetricNames(t *testing.T) {
	for _, tc := range []struct {
		expr string
		want []string
	}{
		{`kvmesh_a_total`, []string{"kvmesh_a_total"}},
		{`sum by (reason) (rate(kvmesh_dead_letters_total{job="sender", reason=~"x|y"}[$__rate_interval]))`, []string{"kvmesh_dead_letters_total"}},
		{`histogram_quantile(0.99, sum by (le, op) (rate(kvmesh_store_op_duration_seconds_bucket[5m])))`, []string{"kvmesh_store_op_duration_seconds_bucket"}},
		{`sum(rate(a{x="kvmesh_not_a_metric"}[1m])) / on(job) group_left(instance) sum without (le) (b) > bool 2^30`, []string{"a", "b"}},
		{`max(kvmesh_outbox_backlog) offset 5m and kvmesh_x unless kvmesh_y`, []string{"kvmesh_outbox_backlog", "kvmesh_x", "kvmesh_y"}},
		{`sum(increase(m[${__range}])) * 1e9 + count(m) + 0.5`, []string{"m"}},
		{`label_values(kvmesh_gpuworker_pool_blocks, engine)`, []string{"kvmesh_gpuworker_pool_blocks"}},
		{`label_values(engine)`, nil},
		{`query_result(topk(5, sum by (op) (kvmesh_store_keys_total)))`, []string{"kvmesh_store_keys_total"}},
		{`rate(x:recorded:rate5m[1m])`, []string{"x:recorded:rate5m"}},
		{`sum(kvmesh_a{l="with \" quote"}) + kvmesh_a`, []string{"kvmesh_a"}},
		{`histogram_quantile(0.99, sum by (le, operation) (rate(vllm:mooncake_store_operation_time_seconds_bucket{status="ok"}[5m])))`,
			[]string{"vllm:mooncake_store_operation_time_seconds_bucket"}},
	} {
		if got := deploy.MetricNames(tc.expr); !slices.Equal(got, tc.want) {
			t.Errorf("MetricNames(%q) = %q, want %q", tc.expr, got, tc.want)
		}
	}
}

func TestFamily(t *testing.T) {
	for in, want := range map[string]string{
		"kvmesh_x_seconds_bucket": "kvmesh_x_seconds", "kvmesh_x_seconds_sum": "kvmesh_x_seconds",
		"kvmesh_x_seconds_count": "kvmesh_x_seconds", "kvmesh_x_total": "kvmesh_x_total",
		"vllm:mooncake_store_operation_time_seconds_bucket": "vllm:mooncake_store_operation_time_seconds",
	} {
		if got := deploy.Family(in); got != want {
			t.Errorf("Family(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestDefinedMetricsReadsLiteralsAndCompositions(t *testing.T) {
	root := t.TempDir()
	write := func(rel, src string) { writeFile(t, root, rel, src) }
	write("pkg/a/a.go", `package a
const name = "kvmesh_literal_total"
// kvmesh_in_a_comment_total is not a definition.
type Opts struct{ Namespace, Subsystem, Name string }
var o = Opts{Namespace: "kvmesh", Subsystem: "sub", Name: "composed_total"}
var p = Opts{Name: "kvmesh_plain_seconds"}
var notMetric = "kvmesh.topic.name"
`)
	write("services/s/internal/m/m.go", `package m
var x = []string{"kvmesh_service_bytes_total", "vllm:served_under_vllms_name_total", "other:not_ours_total"}
`)
	write("services/s/internal/m/m_test.go", `package m
var y = "kvmesh_only_in_a_test_total"
`)
	write("cmd/c/c.go", `package main
var z = "kvmesh_outside_pkg_and_services_total"
`)
	got, err := deploy.DefinedMetrics(root)
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"kvmesh_literal_total", "kvmesh_plain_seconds", "kvmesh_service_bytes_total", "kvmesh_sub_composed_total",
		"vllm:served_under_vllms_name_total"}
	if !slices.Equal(got, want) {
		t.Errorf("DefinedMetrics = %q, want %q", got, want)
	}
}

// composeFixture is a small compose file that CheckServiceConfig accepts;
// the mutations below each break one rule.
const composeFixture = `
x-env: &env
  KVMESH_KAFKA_BROKERS: kafka:9092
services:
  kafka:
    image: apache/kafka:3.9.1
    expose: ["9092"]
    healthcheck: {test: ["CMD", "true"]}
  redis:
    image: redis:7
    expose: ["6379"]
    healthcheck: {test: ["CMD", "redis-cli", "ping"]}
  migrate:
    image: kvmesh:local
    entrypoint: ["/usr/local/bin/kvmesh"]
    restart: "no"
  lookup:
    image: kvmesh:local
    entrypoint: ["/usr/local/bin/lookup"]
    environment:
      <<: *env
      KVMESH_HTTP_ADDR: ":8081"
      KVMESH_REDIS_URL: ${REDIS_URL:-redis://redis:6379/0}
    ports: ["8081:8081"]
    depends_on:
      kafka: {condition: service_healthy}
      redis: {condition: service_healthy}
    healthcheck:
      test: ["CMD", "/usr/local/bin/kvmesh", "probe", "http://127.0.0.1:8081/readyz"]
`

// fixtureConfig stands in for a service's Config.
type fixtureConfig struct {
	HTTPAddr    string   `env:"KVMESH_HTTP_ADDR"`
	Brokers     []string `env:"KVMESH_KAFKA_BROKERS"`
	RedisURL    string   `env:"KVMESH_REDIS_URL" required:"true"`
	DatabaseURL string   `env:"KVMESH_DATABASE_URL"`
	Timeout     string   `env:"KVMESH_TIMEOUT"`
}

// SetDefaults gives the fixture's defaults (config.Defaulter).
func (c *fixtureConfig) SetDefaults() {
	c.HTTPAddr = ":8081"
	c.Brokers = []string{"127.0.0.1:9092"}
	c.Timeout = "1s"
}

// Validate rejects a timeout of "never", so a loaded-but-invalid setting
// can be shown.
func (c *fixtureConfig) Validate() error {
	if c.Timeout == "never" {
		return errors.New("KVMESH_TIMEOUT: never is not a duration")
	}
	return nil
}

func TestCheckServiceConfigCatchesMistakes(t *testing.T) {
	for _, tc := range []struct {
		name      string
		old, new  string
		wantError string
	}{
		{name: "fixture is clean"},
		{name: "unknown variable", old: `KVMESH_HTTP_ADDR: ":8081"`, new: `KVMESH_HTTP_ADDR: ":8081"
      KVMESH_LOOKUP_TYPO: "1"`, wantError: "KVMESH_LOOKUP_TYPO, which its Config does not read"},
		{name: "required unset", old: `KVMESH_REDIS_URL: ${REDIS_URL:-redis://redis:6379/0}`, new: `KVMESH_REDIS_URL: ${REDIS_URL}`,
			wantError: "required KVMESH_REDIS_URL is not set"},
		{name: "invalid setting", old: `KVMESH_HTTP_ADDR: ":8081"`, new: `KVMESH_HTTP_ADDR: ":8081"
      KVMESH_TIMEOUT: never`, wantError: "does not load"},
		{name: "wrong port", old: `KVMESH_HTTP_ADDR: ":8081"`, new: `KVMESH_HTTP_ADDR: ":9000"`, wantError: "want port 8081"},
		{name: "not published", old: `ports: ["8081:8081"]`, new: `ports: ["18081:8081"]`, wantError: "does not publish container port 8081"},
		{name: "no readiness probe", old: `http://127.0.0.1:8081/readyz`, new: `http://127.0.0.1:8081/healthz`, wantError: "no health check probing"},
		{name: "unknown host", old: `redis://redis:6379/0`, new: `redis://valkey:6379/0`, wantError: "valkey:6379, which is no compose service"},
		{name: "wrong port of a dependency", old: `redis://redis:6379/0`, new: `redis://redis:6380/0`, wantError: "redis listens on [6379]"},
		{name: "loopback", old: `KVMESH_KAFKA_BROKERS: kafka:9092`, new: `KVMESH_KAFKA_BROKERS: 127.0.0.1:9092`, wantError: "loopback"},
		{name: "missing dependency", old: `      redis: {condition: service_healthy}
    healthcheck:
      test: ["CMD", "/usr`, new: `    healthcheck:
      test: ["CMD", "/usr`, wantError: "does not depend on redis"},
		{name: "not waiting for health", old: `redis: {condition: service_healthy}
    healthcheck`, new: `redis: {condition: service_started}
    healthcheck`, wantError: "want service_healthy"},
		{name: "database without migrate", old: `KVMESH_HTTP_ADDR: ":8081"`, new: `KVMESH_HTTP_ADDR: ":8081"
      KVMESH_DATABASE_URL: postgres://redis:6379/x`, wantError: "does not depend on migrate"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			src := composeFixture
			if tc.old != "" {
				if !strings.Contains(src, tc.old) {
					t.Fatalf("fixture has no %q", tc.old)
				}
				src = strings.Replace(src, tc.old, tc.new, 1)
			}
			c, err := deploy.ParseCompose([]byte(src), func(string) (string, bool) { return "", false })
			if err != nil {
				t.Fatal(err)
			}
			errs := c.CheckServiceConfig("lookup", &fixtureConfig{})
			if tc.wantError == "" {
				for _, err := range errs {
					t.Error(err)
				}
				return
			}
			if !slices.ContainsFunc(errs, func(err error) bool { return strings.Contains(err.Error(), tc.wantError) }) {
				t.Errorf("errors %v do not include %q", errs, tc.wantError)
			}
		})
	}
}

func TestParseComposeForms(t *testing.T) {
	src := `
services:
  a:
    image: x:1
    environment:
      - LIST_FORM=1
      - EMPTY=
      - BARE
    depends_on: [b]
    ports: ["127.0.0.1:1000:2000/udp", "3000", {target: 4000, published: "4001"}]
    volumes: ["./cfg.yaml:/etc/cfg.yaml:ro", "data:/data", {type: bind, source: ./y, target: /y, read_only: true}]
    command: run --fast
    build: ./ctx
  b:
    image: y:2
    environment: {MAP_FORM: "2", NULL_VALUE: null}
    depends_on:
      a: {condition: service_healthy}
      c: {condition: service_completed_successfully}
    command: ["a b", "c"]
    build: {context: ., dockerfile: build/Dockerfile}
`
	c, err := deploy.ParseCompose([]byte(src), func(string) (string, bool) { return "", false })
	if err != nil {
		t.Fatal(err)
	}
	a, b := c.Services["a"], c.Services["b"]
	if a.Environment["LIST_FORM"] != "1" || a.Environment["EMPTY"] != "" || len(a.Environment) != 3 {
		t.Errorf("list environment %v", a.Environment)
	}
	if b.Environment["MAP_FORM"] != "2" || len(b.Environment) != 2 {
		t.Errorf("map environment %v", b.Environment)
	}
	if a.DependsOn["b"].Condition != deploy.ConditionStarted || b.DependsOn["a"].Condition != deploy.ConditionHealthy ||
		b.DependsOn["c"].Condition != deploy.ConditionCompleted {
		t.Errorf("depends_on %v %v", a.DependsOn, b.DependsOn)
	}
	wantPorts := []deploy.Port{{HostIP: "127.0.0.1", Published: "1000", Target: "2000", Protocol: "udp"}, {Target: "3000", Protocol: "tcp"}, {Published: "4001", Target: "4000", Protocol: "tcp"}}
	if !slices.Equal(a.Ports, wantPorts) {
		t.Errorf("ports %+v, want %+v", a.Ports, wantPorts)
	}
	wantVolumes := []deploy.Volume{{Type: "bind", Source: "./cfg.yaml", Target: "/etc/cfg.yaml", ReadOnly: true},
		{Type: "volume", Source: "data", Target: "/data"}, {Type: "bind", Source: "./y", Target: "/y", ReadOnly: true}}
	if !slices.Equal(a.Volumes, wantVolumes) {
		t.Errorf("volumes %+v, want %+v", a.Volumes, wantVolumes)
	}
	if !slices.Equal(a.Command, deploy.StringList{"run", "--fast"}) || !slices.Equal(b.Command, deploy.StringList{"a b", "c"}) {
		t.Errorf("commands %q %q", a.Command, b.Command)
	}
	if a.Build.DockerfilePath() != "ctx/Dockerfile" || b.Build.DockerfilePath() != "build/Dockerfile" {
		t.Errorf("builds %+v %+v", a.Build, b.Build)
	}
	if _, err := deploy.ParseCompose([]byte("services:\n  a:\n    environment: 3\n"), func(string) (string, bool) { return "", false }); !errors.Is(err, deploy.ErrSyntax) {
		t.Errorf("scalar environment: %v, want ErrSyntax", err)
	}
}

// writeFile writes src to rel under root, making its directories.
func writeFile(t *testing.T, root, rel, src string) {
	t.Helper()
	p := filepath.Join(root, rel)
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, []byte(src), 0o644); err != nil {
		t.Fatal(err)
	}
}
