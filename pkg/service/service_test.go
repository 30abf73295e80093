package service

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/internal/dbtest"
	"github.com/kvmesh/kvmesh/migrations"
	"github.com/kvmesh/kvmesh/pkg/database"
)

func validCommon() Common {
	return Common{LogLevel: "info", Brokers: []string{"127.0.0.1:9092"}, Partitions: 4,
		ShutdownTimeout: 5 * time.Second, SessionTimeout: 10 * time.Second, Model: "dense"}
}

func TestCommonValidate(t *testing.T) {
	tests := []struct {
		name   string
		mutate func(*Common)
		want   string // substring of the error; "" = valid
	}{
		{"valid", func(*Common) {}, ""},
		{"no brokers", func(c *Common) { c.Brokers = nil }, "KVMESH_KAFKA_BROKERS"},
		{"zero partitions", func(c *Common) { c.Partitions = 0 }, "KVMESH_KAFKA_PARTITIONS"},
		{"zero shutdown", func(c *Common) { c.ShutdownTimeout = 0 }, "KVMESH_SHUTDOWN_TIMEOUT"},
		{"bad level", func(c *Common) { c.LogLevel = "loud" }, "KVMESH_LOG_LEVEL"},
		{"no model", func(c *Common) { c.Model = " " }, "KVMESH_MODEL"},
		{"bad key prefix", func(c *Common) { c.KeyPrefix = "a@b" }, "KVMESH_KEY_PREFIX"},
		{"tiny session", func(c *Common) { c.SessionTimeout = time.Millisecond }, "KVMESH_KAFKA_SESSION_TIMEOUT"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := validCommon()
			tt.mutate(&c)
			err := c.Validate()
			if tt.want == "" {
				if err != nil {
					t.Fatalf("unexpected error: %v", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("error %v, want one naming %s", err, tt.want)
			}
		})
	}
}

func TestLoadModel(t *testing.T) {
	m, err := LoadModel("full-swa-mamba")
	if err != nil || len(m.Groups) != 3 {
		t.Fatalf("preset: %v, %+v", err, m)
	}
	path := filepath.Join(t.TempDir(), "m.yaml")
	spec := "name: custom\nhash_block_size: 16\ngroups:\n  - kind: full_attention\n    block_size: 16\n    bytes_per_block: 1024\n"
	if err := os.WriteFile(path, []byte(spec), 0o600); err != nil {
		t.Fatal(err)
	}
	if m, err = LoadModel(path); err != nil || m.Name != "custom" {
		t.Fatalf("file: %v, %+v", err, m)
	}
	if _, err := LoadModel("no-such-model"); err == nil || !strings.Contains(err.Error(), "hybrid-mla-linear") {
		t.Fatalf("unknown model: error %v should list the presets", err)
	}
}

func TestConsumerConfigTimings(t *testing.T) {
	c := validCommon()
	c.SessionTimeout = 2 * time.Second
	cc := c.ConsumerConfig("g", []string{"t"}, slog.New(slog.DiscardHandler))
	if cc.GroupID != "g" || len(cc.Topics) != 1 || len(cc.Brokers) != 1 {
		t.Fatalf("identity fields not carried: %+v", cc)
	}
	if cc.SessionTimeout != 2*time.Second || cc.HeartbeatInterval >= cc.SessionTimeout/3 || cc.RebalanceTimeout < time.Second {
		t.Fatalf("timings session %s heartbeat %s rebalance %s", cc.SessionTimeout, cc.HeartbeatInterval, cc.RebalanceTimeout)
	}
}

func TestRunStopsAllTasksOnFailure(t *testing.T) {
	boom := errors.New("boom")
	stopped := make(chan struct{})
	err := Run(context.Background(), slog.New(slog.DiscardHandler),
		Task{Name: "waiter", Run: func(ctx context.Context) error {
			<-ctx.Done()
			close(stopped)
			return nil
		}},
		Task{Name: "failer", Run: func(context.Context) error { return boom }},
	)
	if !errors.Is(err, boom) || !strings.Contains(err.Error(), "failer") {
		t.Fatalf("got %v, want boom named by its task", err)
	}
	select {
	case <-stopped:
	default:
		t.Fatal("the other task was not stopped")
	}
}

func env(vars map[string]string) func(string) (string, bool) {
	return func(k string) (string, bool) { v, ok := vars[k]; return v, ok }
}

type testConfig struct {
	Common
	Secret string `env:"KVMESH_TEST_SECRET" secret:"true"`
}

func TestMainExitCodes(t *testing.T) {
	ok := func(context.Context, *slog.Logger) error { return nil }
	var out bytes.Buffer
	if code := runMain("t", &testConfig{}, env(map[string]string{"KVMESH_KAFKA_PARTITIONS": "x"}), &out, ok); code != 2 {
		t.Fatalf("bad config: exit %d, want 2 (%s)", code, out.String())
	}
	if !strings.Contains(out.String(), "KVMESH_KAFKA_PARTITIONS") {
		t.Fatalf("bad config message does not name the variable: %s", out.String())
	}
	out.Reset()
	vars := map[string]string{"KVMESH_TEST_SECRET": "hunter2"}
	if code := runMain("t", &testConfig{}, env(vars), &out, ok); code != 0 {
		t.Fatalf("clean run: exit %d (%s)", code, out.String())
	}
	if strings.Contains(out.String(), "hunter2") || !strings.Contains(out.String(), `"starting"`) {
		t.Fatalf("resolved config must be logged with secrets masked: %s", out.String())
	}
	fail := func(context.Context, *slog.Logger) error { return errors.New("nope") }
	if code := runMain("t", &testConfig{}, env(nil), &out, fail); code != 1 {
		t.Fatalf("failed run: exit %d, want 1", code)
	}
}

func TestMainStopsOnSIGTERM(t *testing.T) {
	started := make(chan struct{})
	run := func(ctx context.Context, _ *slog.Logger) error {
		close(started)
		<-ctx.Done()
		return nil
	}
	done := make(chan int, 1)
	var out bytes.Buffer
	go func() { done <- runMain("t", &testConfig{}, env(nil), &out, run) }()
	<-started
	if err := syscall.Kill(os.Getpid(), syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case code := <-done:
		if code != 0 {
			t.Fatalf("exit %d after SIGTERM, want 0", code)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("did not stop within 5 s of SIGTERM")
	}
}

func TestDatabaseReadinessNeedsMigrations(t *testing.T) {
	ctx := context.Background()
	d := NewDeps(slog.New(slog.DiscardHandler))
	defer d.Close()
	if err := d.OpenDatabase(ctx, dbtest.NewDatabase(t), "test", false); err != nil {
		t.Fatal(err)
	}
	check := d.checks[0]
	if err := check.Check(ctx); !errors.Is(err, database.ErrNotMigrated) {
		t.Fatalf("unmigrated database: readiness %v, want ErrNotMigrated", err)
	}
	if _, err := database.Migrate(ctx, d.Pool, migrations.FS); err != nil {
		t.Fatal(err)
	}
	if err := check.Check(ctx); err != nil {
		t.Fatalf("migrated database: readiness %v", err)
	}
}

// TestParallelOverrideRederivesBlockSizes: KVMESH_DCP over a spec that
// gives cache_block_size derives the block size for the new layout; a
// layout vLLM refuses is an error.
func TestParallelOverrideRederivesBlockSizes(t *testing.T) {
	path := filepath.Join(t.TempDir(), "m.json")
	spec := `{"name":"m","hash_block_size":16,"kv_heads":1,"groups":[{"kind":"full_attention","cache_block_size":16,"bytes_per_block":1024}],"parallel":{"tp":4}}`
	if err := os.WriteFile(path, []byte(spec), 0o600); err != nil {
		t.Fatal(err)
	}
	c := Common{Model: path, Parallel: ParallelOverride{DCP: 4}}
	m, err := c.LoadModel()
	if err != nil {
		t.Fatal(err)
	}
	if m.Groups[0].BlockSize != 64 || m.Parallel.DCP != 4 || m.WorldSize() != 4 {
		t.Fatalf("model %+v: want block 16 × dcp 4 = 64 over 4 ranks", m)
	}
	c.Parallel = ParallelOverride{DCP: 3}
	if _, err := c.LoadModel(); err == nil || !strings.Contains(err.Error(), "parallel.dcp") {
		t.Fatalf("dcp 3 at tp 4: %v, want the refusal", err)
	}
}
