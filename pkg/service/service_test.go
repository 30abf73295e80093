package service

import (
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"runtime/debug"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/kvmesh/kvmesh/internal/dbtest"
	"github.com/kvmesh/kvmesh/internal/devbroker"
	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/migrations"
	"github.com/kvmesh/kvmesh/pkg/auth"
	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/database"
	"github.com/kvmesh/kvmesh/pkg/tlsfiles"
)

func validCommon() Common {
	return Common{LogLevel: "info", KafkaBrokers: KafkaBrokers{Brokers: []string{"127.0.0.1:9092"}}, Partitions: 4,
		ShutdownTimeout: 5 * time.Second, SessionTimeout: 10 * time.Second, ModelSpec: ModelSpec{Model: "dense"},
		Auth: auth.Config{Mode: auth.ModeRequired, Key: strings.Repeat("k", auth.MinKeyBytes)}}
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
		{"kafka sasl without password", func(c *Common) {
			c.Kafka = bus.Security{SASLMechanism: bus.SASLScramSHA256, SASLUsername: "u"}
		}, "KVMESH_KAFKA_SASL_PASSWORD"},
		{"kafka unknown mechanism", func(c *Common) {
			c.Kafka = bus.Security{SASLMechanism: "oauthbearer", SASLUsername: "u", SASLPassword: "pw"}
		}, "KVMESH_KAFKA_SASL_MECHANISM"},
		{"kafka CA without tls", func(c *Common) { c.Kafka = bus.Security{CAFile: "/ca.pem"} }, "KVMESH_KAFKA_TLS"},
		{"auth required without a key", func(c *Common) { c.Auth.Key = "" }, "KVMESH_AUTH_KEY"},
		{"auth by default without a key", func(c *Common) { c.Auth = auth.Config{} }, "KVMESH_AUTH=required (the default)"},
		{"short auth key", func(c *Common) { c.Auth.Key = "short" }, "KVMESH_AUTH_KEY"},
		{"unknown auth mode", func(c *Common) { c.Auth.Mode = "sometimes" }, "KVMESH_AUTH"},
		{"auth off without a key", func(c *Common) { c.Auth = auth.Config{Mode: auth.ModeOff} }, ""},
		{"http cert without key", func(c *Common) { c.HTTPTLS.CertFile = "/cert.pem" }, "KVMESH_HTTP_TLS"},
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
	out.Reset()
	if code := runMain("t", &testConfig{}, env(nil), &out, ok); code != 2 || !strings.Contains(out.String(), "KVMESH_AUTH_KEY") {
		t.Fatalf("no auth key: exit %d, want 2 naming KVMESH_AUTH_KEY (%s)", code, out.String())
	}
	out.Reset()
	vars := map[string]string{"KVMESH_TEST_SECRET": "hunter2", "KVMESH_AUTH_KEY": "an-auth-key-of-thirty-two-bytes-or-more"}
	if code := runMain("t", &testConfig{}, env(vars), &out, ok); code != 0 {
		t.Fatalf("clean run: exit %d (%s)", code, out.String())
	}
	if strings.Contains(out.String(), "hunter2") || strings.Contains(out.String(), "thirty-two") || !strings.Contains(out.String(), `"starting"`) {
		t.Fatalf("resolved config must be logged with secrets masked: %s", out.String())
	}
	fail := func(context.Context, *slog.Logger) error { return errors.New("nope") }
	if code := runMain("t", &testConfig{}, env(map[string]string{"KVMESH_AUTH": "off"}), &out, fail); code != 1 {
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
	go func() { done <- runMain("t", &testConfig{}, env(map[string]string{"KVMESH_AUTH": "off"}), &out, run) }()
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
	c := Common{ModelSpec: ModelSpec{Model: path}, Parallel: ParallelOverride{DCP: 4}}
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

func TestCommonLoadsKafkaSecurity(t *testing.T) {
	certs := testenv.NewCerts(t)
	pwFile := filepath.Join(t.TempDir(), "kafka-password")
	if err := os.WriteFile(pwFile, []byte("file-secret-42\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	vars := map[string]string{
		"KVMESH_KAFKA_TLS":                "true",
		"KVMESH_KAFKA_CA_FILE":            certs.CAFile,
		"KVMESH_KAFKA_CERT_FILE":          certs.ClientCert,
		"KVMESH_KAFKA_KEY_FILE":           certs.ClientKey,
		"KVMESH_KAFKA_SERVER_NAME":        "localhost",
		"KVMESH_KAFKA_SASL_MECHANISM":     "SCRAM-SHA-512",
		"KVMESH_KAFKA_SASL_USERNAME":      "kvmesh",
		"KVMESH_KAFKA_SASL_PASSWORD_FILE": pwFile,
		"KVMESH_AUTH":                     "off",
	}
	var out bytes.Buffer
	var cfg testConfig
	ok := func(context.Context, *slog.Logger) error { return nil }
	if code := runMain("t", &cfg, env(vars), &out, ok); code != 0 {
		t.Fatalf("exit %d: %s", code, out.String())
	}
	want := bus.Security{TLS: true, CAFile: certs.CAFile, CertFile: certs.ClientCert, KeyFile: certs.ClientKey,
		ServerName: "localhost", SASLMechanism: "SCRAM-SHA-512", SASLUsername: "kvmesh", SASLPassword: "file-secret-42"}
	if cfg.Kafka != want {
		t.Fatalf("Kafka = %v, want %v", cfg.Kafka, want)
	}
	if strings.Contains(out.String(), "file-secret-42") {
		t.Fatalf("the starting log shows the SASL password: %s", out.String())
	}
	if !strings.Contains(out.String(), "KVMESH_KAFKA_SASL_USERNAME") {
		t.Fatalf("the starting log does not list the Kafka settings: %s", out.String())
	}
	cc := cfg.ConsumerConfig("g", []string{"t"}, slog.New(slog.DiscardHandler))
	if cc.Security != want {
		t.Fatalf("ConsumerConfig.Security = %v, want the Common's", cc.Security)
	}

	vars["KVMESH_KAFKA_SASL_PASSWORD"] = "also-set"
	out.Reset()
	if code := runMain("t", &testConfig{}, env(vars), &out, ok); code != 2 {
		t.Fatalf("password and password file both set: exit %d, want 2 (%s)", code, out.String())
	}
}

// kafkaSecureBroker starts an embedded broker that requires mutual TLS and
// SCRAM-SHA-512, and returns it with the certificates and the user.
func kafkaSecureBroker(t *testing.T) (*devbroker.Broker, *testenv.Certs, devbroker.SASLUser) {
	t.Helper()
	certs := testenv.NewCerts(t)
	u := devbroker.SASLUser{Mechanism: bus.SASLScramSHA512, Name: "kvmesh-svc", Password: "svc-pass-7f3a9c"}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	b, err := devbroker.Start(ctx, devbroker.Config{
		Addr: "127.0.0.1:0", Partitions: 2, GroupMinSessionTimeout: 100 * time.Millisecond,
		SASLUsers: []devbroker.SASLUser{u},
		TLS:       tlsfiles.Files{CertFile: certs.ServerCert, KeyFile: certs.ServerKey, CAFile: certs.CAFile},
	})
	if err != nil {
		t.Fatalf("devbroker.Start: %v", err)
	}
	t.Cleanup(b.Close)
	return b, certs, u
}

// kafkaEnv is the KVMESH_KAFKA_* environment of a service using b with
// the client certificate and u's credentials (password from passwordFile).
func kafkaEnv(b *devbroker.Broker, certs *testenv.Certs, u devbroker.SASLUser, passwordFile string) []string {
	return []string{
		"KVMESH_AUTH=off",
		"KVMESH_KAFKA_BROKERS=" + strings.Join(b.Addrs(), ","),
		"KVMESH_KAFKA_PARTITIONS=2",
		"KVMESH_KAFKA_SESSION_TIMEOUT=2s",
		"KVMESH_KAFKA_TLS=true",
		"KVMESH_KAFKA_CA_FILE=" + certs.CAFile,
		"KVMESH_KAFKA_CERT_FILE=" + certs.ClientCert,
		"KVMESH_KAFKA_KEY_FILE=" + certs.ClientKey,
		"KVMESH_KAFKA_SASL_MECHANISM=" + string(u.Mechanism),
		"KVMESH_KAFKA_SASL_USERNAME=" + u.Name,
		"KVMESH_KAFKA_SASL_PASSWORD_FILE=" + passwordFile,
		"KVMESH_LOG_LEVEL=debug",
		"KVMESH_SHUTDOWN_TIMEOUT=2s",
	}
}

// writeSecret writes a password file.
func writeSecret(t *testing.T, password string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "kafka-password")
	if err := os.WriteFile(path, []byte(password+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// TestServicesReadyOverKafkaTLSAndSASL runs the lookup and the scheduler
// binaries against a broker that requires mutual TLS and SCRAM-SHA-512:
// given the KVMESH_KAFKA_* settings they become ready (the lookup's kafka
// readiness check pings through them), the scheduler's consumers join
// their group and its lag is read through them, and neither logs the
// password. A lookup with a wrong password never becomes ready.
func TestServicesReadyOverKafkaTLSAndSASL(t *testing.T) {
	redisURL := testenv.RedisURL(t)
	dbURL := dbtest.NewDatabase(t)
	bins := testenv.BuildBinaries(t, "./services/lookup", "./services/scheduler")
	b, certs, u := kafkaSecureBroker(t)
	ps := testenv.NewProcs(t)

	kafka := kafkaEnv(b, certs, u, writeSecret(t, u.Password))
	lookup, err := ps.Add("lookup", bins[0], append(kafka, "KVMESH_REDIS_URL="+redisURL,
		"KVMESH_KEY_PREFIX=kafkasec-"+strconv.FormatInt(time.Now().UnixNano(), 36))...)
	if err != nil {
		t.Fatal(err)
	}
	sched, err := ps.Add("scheduler", bins[1], append(kafka, "KVMESH_DATABASE_URL="+dbURL, "KVMESH_SCHEDULER_CONSUMERS=1")...)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range []*testenv.Process{lookup, sched} {
		if err := p.Start(); err != nil {
			t.Fatalf("not ready over TLS and SASL: %v", err)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := b.Cluster().WaitGroupInfo(ctx, "kvmesh-scheduler", func(g *kfake.GroupInfo) bool {
		return g != nil && g.State == "Stable" && len(g.Members) == 1
	}); err != nil {
		t.Fatalf("the scheduler's consumer never joined its group over TLS and SASL: %v", err)
	}
	waitLagScrape(t, sched.URL()+"/metrics")

	bad, err := ps.Add("lookup-wrong-password", bins[0], append(kafkaEnv(b, certs, u, writeSecret(t, "wrong-pass-b81d")),
		"KVMESH_REDIS_URL="+redisURL)...)
	if err != nil {
		t.Fatal(err)
	}
	if err := bad.Start(); !errors.Is(err, testenv.ErrExited) || !strings.Contains(err.Error(), "create topics") {
		t.Fatalf("a lookup with a wrong Kafka password: %v; want it to exit failing to create its topics", err)
	}

	for _, p := range []*testenv.Process{lookup, sched, bad} {
		log := p.LogTail(1 << 20)
		if !strings.Contains(log, `"starting"`) {
			t.Fatalf("no starting line in the log of %s:\n%s", p.URL(), log)
		}
		for _, secret := range []string{u.Password, "wrong-pass-b81d"} {
			if strings.Contains(log, secret) {
				t.Errorf("a Kafka password is in the log of %s", p.URL())
			}
		}
	}
}

// waitLagScrape polls the scheduler's metrics until its consumer lag is
// reported (read from the brokers through TLS and SASL at scrape time)
// with no failed read.
func waitLagScrape(t *testing.T, url string) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	var last string
	for ; time.Now().Before(deadline); <-tick.C {
		resp, err := http.Get(url)
		if err == nil {
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			last = string(body)
			if strings.Contains(last, bus.MetricConsumerLag+`{group="kvmesh-scheduler"`) &&
				strings.Contains(last, bus.MetricConsumerLagErrors+" 0") {
				return
			}
		}
	}
	t.Fatalf("no consumer lag without errors on %s; last scrape:\n%s", url, grepLines(last, "kvmesh_consumer_lag"))
}

// grepLines returns the lines of s containing sub.
func grepLines(s, sub string) string {
	var out []string
	for line := range strings.SplitSeq(s, "\n") {
		if strings.Contains(line, sub) {
			out = append(out, line)
		}
	}
	return strings.Join(out, "\n")
}

// TestMainSetsGCPercentUnlessGOGC: WithGCPercent sets the collector's
// target, and a GOGC in the environment wins over it.
func TestMainSetsGCPercentUnlessGOGC(t *testing.T) {
	defer debug.SetGCPercent(debug.SetGCPercent(100))
	ok := func(context.Context, *slog.Logger) error { return nil }
	vars := map[string]string{"KVMESH_AUTH": "off"}
	if code := runMain("t", &testConfig{}, env(vars), io.Discard, ok, WithGCPercent(300)); code != 0 {
		t.Fatalf("exit %d", code)
	}
	if got := debug.SetGCPercent(100); got != 300 {
		t.Fatalf("GC percent %d after Main with WithGCPercent(300), want 300", got)
	}
	vars["GOGC"] = "150" // the runtime read it at start; Main must leave it alone
	if code := runMain("t", &testConfig{}, env(vars), io.Discard, ok, WithGCPercent(300)); code != 0 {
		t.Fatalf("exit %d", code)
	}
	if got := debug.SetGCPercent(100); got != 100 {
		t.Fatalf("GC percent %d with GOGC set, want it untouched (100)", got)
	}
}
