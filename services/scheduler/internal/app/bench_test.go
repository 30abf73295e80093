package app_test

import (
	"bufio"
	"context"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"os/signal"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"

	"github.com/kvmesh/kvmesh/internal/dbtest"
	"github.com/kvmesh/kvmesh/internal/servicetest"
	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/database"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/service"
	"github.com/kvmesh/kvmesh/services/scheduler/internal/app"
)

// benchModel is the model of the scheduler benchmarks: one full-attention
// group of 16-token blocks hashed every 16 tokens, so that a 2K prompt has
// 128 hashes and blocks, a 32K one 2048, and a prefill chunk of 8192
// tokens adds 512 blocks.
const benchModel = `name: bench-model
hash_block_size: 16
groups:
  - {kind: full_attention, block_size: 16, bytes_per_block: 1024}
`

// The synthetic engine of the benchmarks (synthEngine).
const (
	// synthRunning is the requests an engine keeps running.
	synthRunning = 256
	// synthBudget is the prefill tokens an engine schedules per step
	// besides its decodes (one token per decoding request): with 2K
	// prompts the turnover it allows makes an engine at synthStepRate
	// publish about 1,200 request updates/s, as a real engine does.
	synthBudget = 12288
	// synthChunk is the most prefill tokens of one request per step.
	synthChunk = 8192
	// synthBlock is the block size and the hash block size of benchModel.
	synthBlock = 16
	// synthStepRate is the steps per second of a fleet engine.
	synthStepRate = 30
	// synthRecordBytes bounds the estimated size of one step record, well
	// below the broker's 1 MiB message limit (as internal/sim does); a
	// step with more is split over several records.
	synthRecordBytes = 768 << 10
)

// Sizes and limits of the benchmarks.
const (
	// updateEngines is the engines of the update-rate benchmarks, one per
	// partition of the engine-steps topic.
	updateEngines = contract.DefaultPartitions
	// warmSteps is the steps each engine runs after filling its requests,
	// applied before a measurement starts.
	warmSteps = 8
	// latencyWindow is how long the latency benchmark produces.
	latencyWindow = 3 * time.Second
	// fleetWindow is how long each fleet stage produces.
	fleetWindow = 4 * time.Second
	// fleetStep is how many engines each fleet stage adds.
	fleetStep = 4
	// fleetMax bounds the fleet ramp.
	fleetMax = 128
	// fleetMaxLag is the most a scheduler that keeps up may be behind its
	// engines at the end of a stage, in seconds of their records.
	fleetMaxLag = 1.0
	// fleetMaxGrowth is the most its lag may grow per second over the
	// second half of a stage (the share of the load it fails to apply).
	fleetMaxGrowth = 0.05
	// fleetReplicas is the scheduler replicas of fleet_3_replicas.
	fleetReplicas = 3
	// benchWait bounds the waits of the benchmarks (a slow scheduler
	// needs longer than a test's waitLimit to apply a measurement).
	benchWait = 3 * time.Minute
	// pgbenchSeconds is how long the pgbench baselines run.
	pgbenchSeconds = 5
)

// BenchmarkScheduler measures one scheduler (an App with its default
// consumers and batch size, 4 partitions) with PostgreSQL's durable
// defaults (fsync and full_page_writes on, turned on for the benchmark
// and restored afterwards) against pgbench's single-row UPDATE on the
// same cluster in the same run:
//
//   - pgbench_update: pgbench's tps, the baseline of the update rates and
//     of the fleet size;
//   - updates_2k and updates_32k: request updates (request events) applied
//     per second, from records produced beforehand by synthetic engines
//     with 2K and 32K prompts (updates_32k also reports how much more a 32K
//     update costs than a 2K one);
//   - p99: engine-step record → save task latency at half the 2K rate,
//     against pgbench's UPDATE latency at the same rate;
//   - fleet: how many engines of 256 running requests at 30 steps/s the
//     scheduler keeps up with, against the engines pgbench's tps would
//     carry at one UPDATE per request update;
//   - fleet_3_replicas: the same with three scheduler replicas (one
//     consumer group, one database, each replica an App with its default
//     consumers and outbox relay) and three times the partitions, so that
//     every consumer of every replica holds one; its baseline is fleet's
//     engines (one replica). All three replicas run in this process, on
//     this machine's cores, with PostgreSQL and the broker: on a machine
//     of few cores (the 2-core dev machine) the figure says how well the
//     replicas share one database and one machine's CPU — that adding
//     replicas costs nothing and loses nothing — not how a fleet of
//     replicas on their own machines scales, which would need as many
//     machines.
//
// scripts/benchreport.sh turns the lines into the report's figures.
func BenchmarkScheduler(b *testing.B) {
	s := newSchedBench(b)
	b.Run("pgbench_update", func(b *testing.B) {
		b.ReportMetric(s.pgbenchTPS(b), "tps")
		s.reportFsync(b)
	})
	b.Run("updates_2k", func(b *testing.B) {
		r := s.updates(b, 2048)
		r.report(b)
		b.ReportMetric(s.pgbenchTPS(b), "pgbench_tps")
		s.reportFsync(b)
	})
	b.Run("p99", func(b *testing.B) {
		s.latency(b)
		s.reportFsync(b)
	})
	s.stopUpdates(b, 2048)
	b.Run("updates_32k", func(b *testing.B) {
		r := s.updates(b, 32768)
		r.report(b)
		b.ReportMetric(s.pgbenchTPS(b), "pgbench_tps")
		if r2 := s.runs[2048]; r2 != nil {
			// The cost of one update at 32K in units of one at 2K.
			b.ReportMetric(r2.rate/r.rate, "cost_vs_2k")
		}
		s.reportFsync(b)
	})
	s.stopUpdates(b, 32768)
	b.Run("fleet", func(b *testing.B) {
		s.fleet(b)
		s.reportFsync(b)
	})
	b.Run("fleet_3_replicas", func(b *testing.B) {
		s.fleetReplicas(b)
		s.reportFsync(b)
	})
}

// schedBench is the state the sub-benchmarks of BenchmarkScheduler share:
// one broker and database per measurement (created before fsync is turned
// on, which makes CREATE DATABASE slow), the pgbench database, and results
// later measurements depend on.
type schedBench struct {
	admin     string // KVMESH_DATABASE_URL
	modelPath string
	model     *kvcore.Model
	envs      map[string]*servicetest.Env
	pgbenchDB string
	script    string // the pgbench UPDATE script

	tps  float64 // pgbench_update's tps, once measured
	runs map[int]*updateRun
	// fleetEngines is fleet's engines, once measured (-1: not yet).
	fleetEngines int

	mu      sync.Mutex
	closers []func() error // run in reverse at the end
}

// newSchedBench prepares the databases and brokers, initialises pgbench's
// tables, and turns fsync and full_page_writes on for the rest of b.
func newSchedBench(b *testing.B) *schedBench {
	b.Helper()
	s := &schedBench{admin: testenv.DatabaseURL(b), envs: map[string]*servicetest.Env{}, runs: map[int]*updateRun{}, fleetEngines: -1}
	s.modelPath = filepath.Join(b.TempDir(), "model.yaml")
	if err := os.WriteFile(s.modelPath, []byte(benchModel), 0o600); err != nil {
		b.Fatal(err)
	}
	m, err := service.LoadModel(s.modelPath)
	if err != nil {
		b.Fatal(err)
	}
	s.model = m
	for _, name := range []string{"2k", "32k", "fleet", "fleet3"} {
		s.envs[name] = servicetest.NewEnv(b)
	}
	s.pgbenchDB = dbtest.NewDatabase(b)
	s.script = filepath.Join(b.TempDir(), "update.sql")
	script := "\\set aid random(1, 100000 * :scale)\nUPDATE pgbench_accounts SET abalance = abalance + 1 WHERE aid = :aid;\n"
	if err := os.WriteFile(s.script, []byte(script), 0o600); err != nil {
		b.Fatal(err)
	}
	if out, err := testenv.Pgbench(b, "-i", "-s", "10", "-q", "-I", "dtGvp", s.pgbenchDB); err != nil {
		b.Fatalf("pgbench -i: %v\n%s", err, out)
	}
	durable(b, s.admin)
	b.Cleanup(func() {
		s.mu.Lock()
		defer s.mu.Unlock()
		for i := len(s.closers) - 1; i >= 0; i-- {
			if err := s.closers[i](); err != nil {
				b.Error(err)
			}
		}
	})
	return s
}

// onClose runs fn at the end of the benchmark (before its databases are
// dropped and fsync is restored).
func (s *schedBench) onClose(fn func() error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closers = append(s.closers, fn)
}

// durable turns fsync and full_page_writes on (PostgreSQL's defaults; the
// dev cluster turns both off) with ALTER SYSTEM for the rest of b, and
// restores each setting's previous source when b ends. It fails when the
// settings cannot be changed so (not a superuser, or a server started with
// them on its command line).
func durable(b *testing.B, adminURL string) {
	b.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), benchWait)
	defer cancel()
	conn, err := pgx.Connect(ctx, adminURL)
	if err != nil {
		b.Fatal(err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	var super bool
	if err := conn.QueryRow(ctx, `SELECT rolsuper FROM pg_roles WHERE rolname = current_user`).Scan(&super); err != nil {
		b.Fatal(err)
	}
	if !super {
		b.Fatal("the benchmark turns fsync on with ALTER SYSTEM, which needs a superuser; run it on the dev cluster (make bench)")
	}
	var restore []string
	want := map[string]string{}
	for _, name := range []string{"fsync", "full_page_writes"} {
		var setting, source, file string
		if err := conn.QueryRow(ctx, `SELECT setting, source, coalesce(sourcefile, '') FROM pg_settings WHERE name = $1`, name).
			Scan(&setting, &source, &file); err != nil {
			b.Fatal(err)
		}
		if setting == "on" {
			continue
		}
		if source == "command line" {
			b.Fatalf("%s=%s is set on the server's command line, which ALTER SYSTEM cannot override; "+
				"restart the dev cluster with scripts/devstack.sh up (it sets it in a configuration file)", name, setting)
		}
		undo := "ALTER SYSTEM RESET " + name
		if filepath.Base(file) == "postgresql.auto.conf" {
			undo = "ALTER SYSTEM SET " + name + " = " + setting
		}
		if _, err := conn.Exec(ctx, "ALTER SYSTEM SET "+name+" = on"); err != nil {
			b.Fatal(err)
		}
		restore = append(restore, undo)
		want[name] = setting
	}
	if len(restore) == 0 {
		return
	}
	var once sync.Once
	var restoreErr error
	undo := func() error {
		once.Do(func() { restoreErr = restoreSettings(adminURL, restore, want) })
		return restoreErr
	}
	// An interrupted benchmark (^C in make bench) restores the settings
	// too: make test relies on fsync off for speed.
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, os.Interrupt, syscall.SIGTERM)
	ended := make(chan struct{})
	go func() {
		select {
		case s := <-sig:
			if err := undo(); err != nil {
				fmt.Fprintf(os.Stderr, "restore fsync: %v\n", err)
			}
			fmt.Fprintf(os.Stderr, "%s: fsync restored\n", s)
			os.Exit(1)
		case <-ended:
		}
	}()
	b.Cleanup(func() {
		signal.Stop(sig)
		close(ended)
		if err := undo(); err != nil {
			b.Errorf("restore fsync: %v", err)
		}
	})
	on := map[string]string{}
	for name := range want {
		on[name] = "on"
	}
	if err := reloadUntil(ctx, conn, on); err != nil {
		b.Fatal(err)
	}
}

// restoreSettings runs the statements that undo durable's ALTER SYSTEM
// and waits until the settings read as want again.
func restoreSettings(adminURL string, restore []string, want map[string]string) error {
	ctx, cancel := context.WithTimeout(context.Background(), benchWait)
	defer cancel()
	conn, err := pgx.Connect(ctx, adminURL)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	for _, sql := range restore {
		if _, err := conn.Exec(ctx, sql); err != nil {
			return fmt.Errorf("%s: %w", sql, err)
		}
	}
	return reloadUntil(ctx, conn, want)
}

// reloadUntil reloads the server's configuration and polls until the
// settings read as want.
func reloadUntil(ctx context.Context, conn *pgx.Conn, want map[string]string) error {
	if _, err := conn.Exec(ctx, `SELECT pg_reload_conf()`); err != nil {
		return err
	}
	return poll(ctx, 10*time.Second, 10*time.Millisecond, func() (bool, error) {
		for name, v := range want {
			var got string
			if err := conn.QueryRow(ctx, `SELECT current_setting($1)`, name).Scan(&got); err != nil {
				return false, err
			}
			if got != v {
				return false, nil
			}
		}
		return true, nil
	})
}

// poll calls cond every interval until it holds, fails, or limit passes.
func poll(ctx context.Context, limit, interval time.Duration, cond func() (bool, error)) error {
	deadline := time.Now().Add(limit)
	tick := time.NewTicker(interval)
	defer tick.Stop()
	for {
		ok, err := cond()
		switch {
		case err != nil:
			return err
		case ok:
			return nil
		case time.Now().After(deadline):
			return fmt.Errorf("not done after %s", limit)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-tick.C:
		}
	}
}

// reportFsync reports fsync_on and fails b unless fsync is still on (the
// figures are only meaningful with it).
func (s *schedBench) reportFsync(b *testing.B) {
	b.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, s.admin)
	if err != nil {
		b.Fatal(err)
	}
	defer conn.Close(ctx)
	var fsync string
	if err := conn.QueryRow(ctx, `SELECT current_setting('fsync')`).Scan(&fsync); err != nil {
		b.Fatal(err)
	}
	if fsync != "on" {
		b.Fatal("fsync went off during the measurement (another session reset it?)")
	}
	b.ReportMetric(1, "fsync_on")
}

// checkpoint runs a CHECKPOINT before a measurement, so that none is
// likely to start in it (max_wal_size) and each measurement starts from
// the same state: the writes of the set-up flushed.
func (s *schedBench) checkpoint(b *testing.B) {
	b.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), benchWait)
	defer cancel()
	conn, err := pgx.Connect(ctx, s.admin)
	if err != nil {
		b.Fatal(err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := conn.Exec(ctx, `CHECKPOINT`); err != nil {
		b.Fatal(err)
	}
}

// tpsLine is pgbench's throughput line.
var tpsLine = regexp.MustCompile(`tps = ([0-9.]+) \(without initial connection time\)`)

// pgbenchTPS runs pgbench's single-row UPDATE (8 clients, 2 threads,
// prepared statements) for pgbenchSeconds once and returns its tps.
func (s *schedBench) pgbenchTPS(b *testing.B) float64 {
	b.Helper()
	if s.tps > 0 {
		return s.tps
	}
	s.checkpoint(b)
	out, err := testenv.Pgbench(b, "-n", "-c", "8", "-j", "2", "-T", strconv.Itoa(pgbenchSeconds), "-M", "prepared", "-f", s.script, s.pgbenchDB)
	if err != nil {
		b.Fatalf("pgbench: %v\n%s", err, out)
	}
	m := tpsLine.FindStringSubmatch(out)
	if m == nil {
		b.Fatalf("pgbench printed no tps line:\n%s", out)
	}
	tps, err := strconv.ParseFloat(m[1], 64)
	if err != nil || tps <= 0 {
		b.Fatalf("pgbench tps %q: %v", m[1], err)
	}
	s.tps = tps
	return tps
}

// pgbenchLatency runs pgbench's UPDATE at rate transactions per second for
// seconds and returns the latency quantiles (ms) of its per-transaction
// log: each transaction's time from its scheduled start, so queueing
// behind a slow one counts, as it does for a step record.
func (s *schedBench) pgbenchLatency(b *testing.B, rate float64, seconds int) (p50, p99 float64) {
	b.Helper()
	dir := b.TempDir()
	s.checkpoint(b)
	out, err := testenv.Pgbench(b, "-n", "-c", "8", "-j", "2", "-T", strconv.Itoa(seconds), "-M", "prepared",
		"-R", strconv.Itoa(int(math.Round(rate))), "-l", "--log-prefix", filepath.Join(dir, "tx"), "-f", s.script, s.pgbenchDB)
	if err != nil {
		b.Fatalf("pgbench -R: %v\n%s", err, out)
	}
	files, _ := filepath.Glob(filepath.Join(dir, "tx.*"))
	var lat []float64
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			b.Fatal(err)
		}
		sc := bufio.NewScanner(strings.NewReader(string(data)))
		for sc.Scan() {
			// client_id transaction_no time script_no time_epoch time_us [schedule_lag]
			fields := strings.Fields(sc.Text())
			if len(fields) < 3 {
				continue
			}
			us, err := strconv.ParseFloat(fields[2], 64)
			if err == nil {
				lat = append(lat, us/1000)
			}
		}
	}
	if len(lat) == 0 {
		b.Fatalf("pgbench -R logged no transactions:\n%s", out)
	}
	slices.Sort(lat)
	return quantile(lat, 0.50), quantile(lat, 0.99)
}

// quantile is the q-quantile of sorted values (nearest rank below).
func quantile[T int64 | float64 | time.Duration](sorted []T, q float64) T {
	return sorted[int(q*float64(len(sorted)-1))]
}

// benchScheduler is one scheduler App a benchmark started, with a pool on
// its database and a writer standing in for its engines.
type benchScheduler struct {
	env    *servicetest.Env
	pool   *pgxpool.Pool
	writer *kafka.Writer
	stop   func() error
}

// startScheduler starts a scheduler on env with its default consumers,
// batch size and maintenance interval, and 4 partitions per topic (the
// contract's default); it runs until stopped, at the latest when the whole
// benchmark ends.
func (s *schedBench) startScheduler(b *testing.B, env *servicetest.Env) *benchScheduler {
	return s.startSchedulerWith(b, env, contract.DefaultPartitions)
}

// startSchedulerWith is startScheduler with topics of the given
// partitions (created by the first scheduler on env).
func (s *schedBench) startSchedulerWith(b *testing.B, env *servicetest.Env, partitions int) *benchScheduler {
	b.Helper()
	cfg := app.Config{Common: env.Common(), HTTP: service.HTTP{HTTPAddr: "127.0.0.1:0"}, Database: service.Database{DatabaseURL: env.DatabaseURL}, Migrate: true}
	cfg.Partitions = partitions
	cfg.Model = s.modelPath
	cfg.LogLevel = "warn"
	ctx, cancel := context.WithCancel(context.Background())
	a, err := app.New(ctx, cfg, testLogger())
	if err != nil {
		cancel()
		b.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	var once sync.Once
	var stopErr error
	bs := &benchScheduler{env: env}
	transport := &kafka.Transport{}
	bs.writer = &kafka.Writer{Addr: kafka.TCP(env.Brokers...), Balancer: &kafka.Murmur2Balancer{},
		BatchTimeout: time.Millisecond, BatchSize: 1 << 14, BatchBytes: 960 << 10, RequiredAcks: kafka.RequireAll,
		Transport: transport}
	bs.stop = func() error {
		once.Do(func() {
			_ = bs.writer.Close()
			transport.CloseIdleConnections()
			if bs.pool != nil {
				bs.pool.Close()
			}
			cancel()
			select {
			case stopErr = <-done:
			case <-time.After(servicetest.StopWithin):
				stopErr = fmt.Errorf("scheduler did not stop within %s", servicetest.StopWithin)
			}
		})
		return stopErr
	}
	s.onClose(bs.stop)
	if err := testenv.WaitReady("http://"+a.Addr()+"/readyz", waitLimit, nil); err != nil {
		b.Fatal(err)
	}
	if bs.pool, err = database.Connect(ctx, env.DatabaseURL); err != nil {
		b.Fatal(err)
	}
	return bs
}

// produce writes msgs (keyed by engine id) and waits for the broker.
func (bs *benchScheduler) produce(b *testing.B, msgs []kafka.Message) {
	b.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), benchWait)
	defer cancel()
	if err := bs.writer.WriteMessages(ctx, msgs...); err != nil {
		b.Fatalf("produce %d step records: %v", len(msgs), err)
	}
}

// appliedAll reports whether the scheduler applied every engine's last
// step record (an engine's records are applied in order).
func (bs *benchScheduler) appliedAll(ctx context.Context, engines []*synthEngine) (bool, error) {
	ids, last := make([]string, 0, len(engines)), make([]string, 0, len(engines))
	for _, e := range engines {
		if e.lastID != "" {
			ids, last = append(ids, e.id), append(last, e.lastID)
		}
	}
	var n int
	err := bs.pool.QueryRow(ctx, `SELECT count(*) FROM unnest($1::text[], $2::text[]) AS k(e, i) WHERE EXISTS
		(SELECT 1 FROM processed_records p WHERE p.kind = 'step' AND p.engine_id = k.e AND p.request_id = '' AND p.id = k.i)`,
		ids, last).Scan(&n)
	return n == len(ids), err
}

// appliedSince counts the step records the scheduler applied in
// transactions that started at since or later (database time).
func (bs *benchScheduler) appliedSince(ctx context.Context, since time.Time) (int, error) {
	var n int
	err := bs.pool.QueryRow(ctx, `SELECT count(*) FROM processed_records WHERE processed_at >= $1 AND kind = 'step'`, since).Scan(&n)
	return n, err
}

// now is the database's clock.
func (bs *benchScheduler) now(ctx context.Context) (time.Time, error) {
	var t time.Time
	err := bs.pool.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&t)
	return t, err
}

// waitApplied polls every interval until every record of engines is
// applied.
func (bs *benchScheduler) waitApplied(b *testing.B, engines []*synthEngine, interval time.Duration) {
	b.Helper()
	ctx := context.Background()
	if err := poll(ctx, benchWait, interval, func() (bool, error) { return bs.appliedAll(ctx, engines) }); err != nil {
		b.Fatalf("waiting for the scheduler to apply every step record: %v", err)
	}
}

// waitOutbox waits until the outbox relay published every committed task.
func (bs *benchScheduler) waitOutbox(b *testing.B) {
	b.Helper()
	ctx := context.Background()
	err := poll(ctx, benchWait, 20*time.Millisecond, func() (bool, error) {
		var n int
		err := bs.pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE sent_at IS NULL`).Scan(&n)
		return n == 0, err
	})
	if err != nil {
		b.Fatalf("waiting for the outbox to drain: %v", err)
	}
}

// checkClean fails b when a request errored or a record was dead-lettered:
// the synthetic engines' events must all be valid, or the figures measure
// something else.
func (bs *benchScheduler) checkClean(b *testing.B) {
	b.Helper()
	var errored, dead int
	var first string
	err := bs.pool.QueryRow(context.Background(), `SELECT (SELECT count(*) FROM trackers WHERE error IS NOT NULL),
		(SELECT coalesce(min(error), '') FROM trackers WHERE error IS NOT NULL),
		(SELECT count(*) FROM dead_letters WHERE service = 'scheduler')`).Scan(&errored, &first, &dead)
	if err != nil {
		b.Fatal(err)
	}
	if errored > 0 || dead > 0 {
		b.Fatalf("%d requests errored (%s), %d records dead-lettered", errored, first, dead)
	}
}

// pause holds the scheduler's next transactions (they insert into
// processed_records first) until the returned function runs: records can
// be produced beforehand without the scheduler applying any.
func (bs *benchScheduler) pause(b *testing.B) func() {
	b.Helper()
	ctx := context.Background()
	tx, err := bs.pool.Begin(ctx)
	if err != nil {
		b.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `LOCK TABLE processed_records IN EXCLUSIVE MODE`); err != nil {
		_ = tx.Rollback(ctx)
		b.Fatal(err)
	}
	return func() {
		if err := tx.Commit(ctx); err != nil {
			b.Fatal(err)
		}
	}
}

// updateRun is one update-rate measurement: its scheduler and engines
// (kept for the latency benchmark) and what it measured.
type updateRun struct {
	sched   *benchScheduler
	engines []*synthEngine
	// events and records are the request updates and step records timed.
	events, records int
	elapsed         time.Duration
	// rate is events per second.
	rate float64
}

// report reports the run's figures on b.
func (r *updateRun) report(b *testing.B) {
	b.ReportMetric(r.rate, "updates/s")
	b.ReportMetric(float64(r.records)/r.elapsed.Seconds(), "records/s")
	b.ReportMetric(float64(r.events)/float64(r.records), "updates/record")
	b.ReportMetric(float64(r.events), "updates")
}

// updateTarget is the request updates an update-rate measurement times,
// by prompt length: a few seconds of work each.
var updateTarget = map[int]int{2048: 40000, 32768: 16000}

// updates measures (once per prompt length) the request updates per
// second one scheduler applies from updateEngines synthetic engines: every
// engine first fills its 256 running requests and runs warmSteps steps,
// applied and published untimed; then the records of the timed steps are
// produced while the scheduler is paused, and the timer runs from the
// pause's end until every record is applied.
func (s *schedBench) updates(b *testing.B, prompt int) *updateRun {
	b.Helper()
	if r := s.runs[prompt]; r != nil {
		return r
	}
	name := fmt.Sprintf("%dk", prompt/1024)
	bs := s.startScheduler(b, s.envs[name])
	r := &updateRun{sched: bs}
	for i, id := range engineIDs("u"+name, contract.DefaultPartitions, 0, updateEngines) {
		r.engines = append(r.engines, newSynthEngine(id, s.model.Name, prompt, uint64(prompt+i)))
	}
	var warm []kafka.Message
	for _, e := range r.engines {
		warm = append(warm, e.encode(e.fill())...)
		for range warmSteps {
			warm = append(warm, e.encode(e.step())...)
		}
	}
	bs.produce(b, warm)
	bs.waitApplied(b, r.engines, 20*time.Millisecond)
	bs.waitOutbox(b)

	var msgs []kafka.Message
	for r.events < updateTarget[prompt] {
		for _, e := range r.engines {
			evs := e.step()
			r.events += len(evs)
			rec := e.encode(evs)
			r.records += len(rec)
			msgs = append(msgs, rec...)
		}
	}
	resume := bs.pause(b)
	bs.produce(b, msgs)
	s.checkpoint(b)
	start := time.Now()
	resume()
	bs.waitApplied(b, r.engines, 10*time.Millisecond)
	r.elapsed = time.Since(start)
	r.rate = float64(r.events) / r.elapsed.Seconds()
	bs.checkClean(b)
	s.runs[prompt] = r
	b.Logf("%s: %d updates in %d records applied in %s: %.0f updates/s", name, r.events, r.records, r.elapsed.Round(time.Millisecond), r.rate)
	return r
}

// stopUpdates stops the scheduler of an update-rate run, if one runs, so
// that it takes no CPU from the next measurement.
func (s *schedBench) stopUpdates(b *testing.B, prompt int) {
	if r := s.runs[prompt]; r != nil {
		if err := r.sched.stop(); err != nil {
			b.Error(err)
		}
	}
}

// latency measures the engine-step record → save task latency at half the
// 2K update rate: the 2K run's engines go on stepping, their records
// produced at a steady rate of updates for latencyWindow, and each save
// task's arrival on kvmesh.save.tasks is timed from the produce call of the
// record whose new step caused it. pgbench's UPDATE at the same rate of
// transactions is the baseline.
func (s *schedBench) latency(b *testing.B) {
	r := s.updates(b, 2048)
	bs := r.sched
	bs.waitOutbox(b)
	rate := r.rate / 2

	// The plan: step records in production order, each with the
	// cumulative updates due by its end and the saves it causes.
	type planned struct {
		msgs  []kafka.Message
		due   int
		saves []string
	}
	var plan []planned
	total, short := 0, 0
	for total < int(rate*latencyWindow.Seconds()) {
		for _, e := range r.engines {
			evs := e.step()
			total += len(evs)
			p := planned{msgs: e.encode(evs), due: total}
			for _, ev := range evs {
				// A new step that computed less than one block (the end of
				// a step's token budget) saves nothing yet: its first save
				// comes with a later step, perhaps after the window.
				if ev.Kind != contract.EventScheduled || ev.Step.Kind != kvcore.StepNew {
					continue
				}
				if ev.Step.Tokens < s.model.SchedulerBlockSize() {
					short++
					continue
				}
				p.saves = append(p.saves, e.id+"/"+ev.RequestID)
			}
			plan = append(plan, p)
		}
	}
	saves := newSaveReader(b, bs.env.Brokers)
	s.checkpoint(b)
	transport := &kafka.Transport{}
	// Acknowledged, synchronous writes, one call at a time. kafka-go's
	// writer defaults to no acknowledgement: it then sends the next
	// produce request without waiting for the last, and requests on two
	// connections put a later step record of an engine before an earlier
	// one on the partition (offsets 391 and 393 holding steps 391 and
	// 390); the scheduler failed the late record's requests closed, as the
	// contract says, and their saves never came.
	w := &kafka.Writer{Addr: kafka.TCP(bs.env.Brokers...), Balancer: &kafka.Murmur2Balancer{}, BatchTimeout: time.Millisecond,
		BatchBytes: 960 << 10, RequiredAcks: kafka.RequireAll, Transport: transport}
	defer transport.CloseIdleConnections()
	sent := map[string]time.Time{}
	tick := time.NewTicker(2 * time.Millisecond)
	defer tick.Stop()
	start := time.Now()
	for next := 0; next < len(plan); <-tick.C {
		now := time.Now()
		due := int(now.Sub(start).Seconds() * rate)
		var msgs []kafka.Message
		for ; next < len(plan) && plan[next].due <= due; next++ {
			msgs = append(msgs, plan[next].msgs...)
			for _, k := range plan[next].saves {
				sent[k] = now
			}
		}
		if len(msgs) > 0 {
			if err := w.WriteMessages(context.Background(), msgs...); err != nil {
				b.Fatal(err)
			}
		}
	}
	window := time.Since(start)
	if err := w.Close(); err != nil {
		b.Fatal(err)
	}
	var lat []time.Duration
	err := poll(context.Background(), benchWait, 20*time.Millisecond, func() (bool, error) {
		lat = saves.latencies(sent)
		return len(lat) == len(sent), nil
	})
	if err != nil {
		b.Errorf("%d of %d save tasks arrived: %v", len(lat), len(sent), err)
		bs.explainMissing(b, saves, sent)
		b.FailNow()
	}
	bs.checkClean(b)
	slices.Sort(lat)
	ms := func(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
	p50, p99 := quantile(lat, 0.50), quantile(lat, 0.99)
	b.ReportMetric(ms(p50), "p50-ms")
	b.ReportMetric(ms(p99), "p99-ms")
	b.ReportMetric(ms(lat[len(lat)-1]), "max-ms")
	b.ReportMetric(float64(total)/window.Seconds(), "updates/s")
	b.ReportMetric(r.rate, "saturation_updates/s")
	b.ReportMetric(float64(len(lat)), "saves")
	b.ReportMetric(float64(short), "new_steps_under_a_block")
	pg50, pg99 := s.pgbenchLatency(b, rate, int(latencyWindow.Seconds()))
	b.ReportMetric(pg50, "pgbench_p50-ms")
	b.ReportMetric(pg99, "pgbench_p99-ms")
	b.Logf("at %.0f updates/s (half of %.0f): record → save task p50 %.1f ms, p99 %.1f ms over %d saves; pgbench UPDATE p50 %.2f ms, p99 %.2f ms",
		float64(total)/window.Seconds(), r.rate, ms(p50), ms(p99), len(lat), pg50, pg99)
}

// saveReader reads every partition of kvmesh.save.tasks from its end as of
// its creation and times each task's arrival, by engine and request id.
type saveReader struct {
	mu      sync.Mutex
	arrived map[string]time.Time
}

// newSaveReader starts a saveReader, which stops when b ends.
// explainMissing logs, for each expected save task that did not arrive,
// what PostgreSQL holds of it: its request's tracker and its outbox rows.
func (bs *benchScheduler) explainMissing(b *testing.B, saves *saveReader, sent map[string]time.Time) {
	saves.mu.Lock()
	var missing []string
	for k := range sent {
		if _, ok := saves.arrived[k]; !ok {
			missing = append(missing, k)
		}
	}
	saves.mu.Unlock()
	dl, err := bs.pool.Query(context.Background(), `SELECT topic, reason, left(detail, 300) FROM dead_letters WHERE service = 'scheduler' ORDER BY id LIMIT 10`)
	if err == nil {
		for dl.Next() {
			var topic, reason, detail string
			_ = dl.Scan(&topic, &reason, &detail)
			b.Logf("scheduler dead letter on %s: %s: %s", topic, reason, detail)
		}
		dl.Close()
	}
	if len(missing) > 0 {
		bs.explainOrder(b, missing[0])
	}
	for _, k := range missing {
		engine, req, _ := strings.Cut(k, "/")
		var state, tracker string
		var rows, unsent int
		err := bs.pool.QueryRow(context.Background(), `SELECT t.state, t.tracker::text,
			(SELECT count(*) FROM outbox o WHERE o.topic = $3 AND o.key = t.request_id),
			(SELECT count(*) FROM outbox o WHERE o.topic = $3 AND o.key = t.request_id AND o.sent_at IS NULL)
			FROM trackers t WHERE t.engine_id = $1 AND t.request_id = $2`, engine, req, contract.TopicSaveTasks).
			Scan(&state, &tracker, &rows, &unsent)
		b.Logf("missing save of %s: state %s, %d save rows in the outbox (%d unsent), %v; tracker %s", k, state, rows, unsent, err, tracker)
	}
}

// explainOrder logs where the events of the request named by key (engine
// id/request id) sit on kvmesh.engine.steps: offsets and seqs in topic
// order.
func (bs *benchScheduler) explainOrder(b *testing.B, key string) {
	engine, req, _ := strings.Cut(key, "/")
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for p := range contract.DefaultPartitions {
		r := kafka.NewReader(kafka.ReaderConfig{Brokers: bs.env.Brokers, Topic: contract.TopicEngineSteps, Partition: p, MaxWait: 250 * time.Millisecond})
		for {
			m, err := r.ReadMessage(ctx)
			if err != nil {
				break
			}
			if string(m.Key) == engine {
				var st contract.EngineStep
				if json.Unmarshal(m.Value, &st) == nil {
					for _, ev := range st.Requests {
						if ev.RequestID == req {
							b.Logf("order: %s partition %d offset %d time %s step %s: seq %d %s", key, p, m.Offset, m.Time.Format("15:04:05.000"), st.StepID, ev.Seq, ev.Kind)
						}
					}
				}
			}
			if r.Lag() == 0 {
				break
			}
		}
		_ = r.Close()
	}
	rows, err := bs.pool.Query(ctx, `SELECT id, processed_at FROM processed_records WHERE engine_id = $1 ORDER BY processed_at DESC LIMIT 5`, engine)
	if err == nil {
		for rows.Next() {
			var id string
			var at time.Time
			_ = rows.Scan(&id, &at)
			b.Logf("order: latest processed step of %s: %s at %s", engine, id, at.Format("15:04:05.000"))
		}
		rows.Close()
	}
}

func newSaveReader(b *testing.B, brokers []string) *saveReader {
	b.Helper()
	sr := &saveReader{arrived: map[string]time.Time{}}
	transport := &kafka.Transport{}
	client := &kafka.Client{Addr: kafka.TCP(brokers...), Transport: transport}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	b.Cleanup(func() {
		cancel()
		wg.Wait()
		transport.CloseIdleConnections()
	})
	meta, err := client.Metadata(ctx, &kafka.MetadataRequest{Topics: []string{contract.TopicSaveTasks}})
	if err != nil || len(meta.Topics) != 1 {
		b.Fatalf("metadata of %s: %v", contract.TopicSaveTasks, err)
	}
	req := &kafka.ListOffsetsRequest{Topics: map[string][]kafka.OffsetRequest{}}
	for _, p := range meta.Topics[0].Partitions {
		req.Topics[contract.TopicSaveTasks] = append(req.Topics[contract.TopicSaveTasks], kafka.LastOffsetOf(p.ID))
	}
	offsets, err := client.ListOffsets(ctx, req)
	if err != nil {
		b.Fatal(err)
	}
	for _, p := range offsets.Topics[contract.TopicSaveTasks] {
		if p.Error != nil {
			b.Fatal(p.Error)
		}
		r := kafka.NewReader(kafka.ReaderConfig{Brokers: brokers, Topic: contract.TopicSaveTasks, Partition: p.Partition,
			MinBytes: 1, MaxBytes: 1 << 22,
			// A short MaxWait makes kafka-go's fetch deadline race the
			// broker's answer: a lost race reconnects, ~100 ms of the
			// reader's own that would count as the scheduler's latency.
			MaxWait: 250 * time.Millisecond})
		if err := r.SetOffset(p.LastOffset); err != nil {
			b.Fatal(err)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer r.Close()
			for {
				m, err := r.ReadMessage(ctx)
				if err != nil {
					return
				}
				at := time.Now()
				var ids struct {
					EngineID  string `json:"engine_id"`
					RequestID string `json:"request_id"`
				}
				if json.Unmarshal(m.Value, &ids) == nil {
					sr.mu.Lock()
					k := ids.EngineID + "/" + ids.RequestID
					if _, ok := sr.arrived[k]; !ok {
						sr.arrived[k] = at
					}
					sr.mu.Unlock()
				}
			}
		}()
	}
	return sr
}

// latencies returns, for each key of sent whose save task arrived, the
// time from sent to its arrival.
func (sr *saveReader) latencies(sent map[string]time.Time) []time.Duration {
	sr.mu.Lock()
	defer sr.mu.Unlock()
	out := make([]time.Duration, 0, len(sent))
	for k, at := range sent {
		if got, ok := sr.arrived[k]; ok {
			out = append(out, got.Sub(at))
		}
	}
	return out
}

// fleet ramps the number of synthetic 2K engines stepping at synthStepRate
// against one scheduler, fleetStep more per stage, each stage producing
// for fleetWindow, and reports the largest count it kept up with: at the
// end of the stage it is at most fleetMaxLag seconds of records behind,
// and its lag grew by at most fleetMaxGrowth per second over the stage's
// second half. The engines a stage adds fill their requests (applied)
// before it starts; between stages the scheduler catches up. After the
// first stage it cannot keep up with, the counts between the last good
// one and it are tried, from the middle. The baseline is the engines
// pgbench's tps would carry at one single-row UPDATE per request update.
func (s *schedBench) fleet(b *testing.B) {
	bs := s.startScheduler(b, s.envs["fleet"])
	best := s.fleetRamp(b, bs, "fleet", contract.DefaultPartitions)
	s.fleetEngines = best
	bs.checkClean(b)
	if err := bs.stop(); err != nil { // its CPU is the replicas' next
		b.Error(err)
	}
}

// fleetReplicas ramps the fleet as fleet does against fleetReplicas
// scheduler replicas of one consumer group on one database, the topics
// with fleetReplicas times the partitions (one per consumer of every
// replica), and reports engines against fleet's (one replica).
func (s *schedBench) fleetReplicas(b *testing.B) {
	if s.fleetEngines < 0 {
		b.Skip("fleet_3_replicas needs fleet's figure (run it with fleet)")
	}
	env := s.envs["fleet3"]
	partitions := fleetReplicas * contract.DefaultPartitions
	reps := make([]*benchScheduler, fleetReplicas)
	for i := range reps {
		reps[i] = s.startSchedulerWith(b, env, partitions)
	}
	waitGroupStable(b, env.Brokers, fleetReplicas*app.DefaultConfig().Consumers)
	best := s.fleetRamp(b, reps[0], "fleet3", partitions)
	reps[0].checkClean(b)
	b.ReportMetric(float64(best), "engines")
	b.ReportMetric(float64(s.fleetEngines), "baseline_engines")
	b.ReportMetric(float64(fleetReplicas), "replicas")
}

// waitGroupStable waits until the scheduler's consumer group is stable
// with members members, so that no rebalance starts inside a stage.
func waitGroupStable(b *testing.B, brokers []string, members int) {
	b.Helper()
	transport := &kafka.Transport{}
	defer transport.CloseIdleConnections()
	client := &kafka.Client{Addr: kafka.TCP(brokers...), Transport: transport}
	ctx := context.Background()
	var last string
	err := poll(ctx, benchWait, 100*time.Millisecond, func() (bool, error) {
		resp, err := client.DescribeGroups(ctx, &kafka.DescribeGroupsRequest{GroupIDs: []string{app.GroupID}})
		if err != nil || len(resp.Groups) != 1 {
			last = fmt.Sprint(err)
			return false, nil
		}
		g := resp.Groups[0]
		last = fmt.Sprintf("%s with %d members", g.GroupState, len(g.Members))
		return g.Error == nil && g.GroupState == "Stable" && len(g.Members) == members, nil
	})
	if err != nil {
		b.Fatalf("consumer group %s not stable with %d members (%s): %v", app.GroupID, members, last, err)
	}
}

// fleetRamp runs fleet's ramp of engines (ids from prefix, spread over
// partitions) producing through bs and measuring through bs's pool, and
// reports its figures (engines against pgbench's) on b; it returns the
// most engines kept up with.
func (s *schedBench) fleetRamp(b *testing.B, bs *benchScheduler, prefix string, partitions int) int {
	var engines []*synthEngine
	updates, steps := 0, 0
	stage := func(n int) bool {
		if n > len(engines) {
			var fill []kafka.Message
			for i, id := range engineIDs(prefix, partitions, len(engines), n-len(engines)) {
				e := newSynthEngine(id, s.model.Name, 2048, uint64(1000+len(engines)+i))
				fill = append(fill, e.encode(e.fill())...)
				engines = append(engines, e)
			}
			bs.produce(b, fill)
		}
		active := engines[:n]
		bs.waitApplied(b, engines, 20*time.Millisecond)
		bs.waitOutbox(b)
		// Plan: engine j's k-th step is due at (k + j/n) / synthStepRate.
		type planned struct {
			at   time.Duration
			msgs []kafka.Message
		}
		var plan []planned
		perEngine := int(fleetWindow.Seconds() * synthStepRate)
		for k := range perEngine {
			for j, e := range active {
				evs := e.step()
				updates, steps = updates+len(evs), steps+1
				at := time.Duration((float64(k) + float64(j)/float64(n)) / synthStepRate * float64(time.Second))
				plan = append(plan, planned{at: at, msgs: e.encode(evs)})
			}
		}
		s.checkpoint(b)
		ctx := context.Background()
		since, err := bs.now(ctx)
		if err != nil {
			b.Fatal(err)
		}
		type sample struct {
			t   float64 // seconds into the stage
			lag float64 // records produced but not applied
		}
		var samples []sample
		produced := 0
		tick := time.NewTicker(5 * time.Millisecond)
		defer tick.Stop()
		start := time.Now()
		nextSample := time.Duration(0)
		for next := 0; ; <-tick.C {
			el := time.Since(start)
			var msgs []kafka.Message
			for ; next < len(plan) && plan[next].at <= el; next++ {
				msgs = append(msgs, plan[next].msgs...)
			}
			if len(msgs) > 0 {
				bs.produce(b, msgs)
				produced += len(msgs)
			}
			done := next == len(plan) && el >= fleetWindow
			if el >= nextSample || done {
				a, err := bs.appliedSince(ctx, since)
				if err != nil {
					b.Fatal(err)
				}
				samples = append(samples, sample{t: time.Since(start).Seconds(), lag: float64(produced - a)})
				nextSample += 100 * time.Millisecond
			}
			if done {
				break
			}
		}
		perSecond := float64(produced) / fleetWindow.Seconds()
		end := samples[len(samples)-1].lag / perSecond
		var half []sample
		for _, sm := range samples {
			if sm.t >= fleetWindow.Seconds()/2 {
				half = append(half, sm)
			}
		}
		growth := slope(half, func(sm sample) (float64, float64) { return sm.t, sm.lag / perSecond })
		ok := end <= fleetMaxLag && growth <= fleetMaxGrowth
		b.Logf("fleet: %d engines (%.0f updates/s): lag %.2f s at the end, growing %.3f s/s: kept up %v",
			n, float64(updates)/float64(steps)*synthStepRate*float64(n), end, growth, ok)
		return ok
	}
	best, failed := 0, 0
	for n := fleetStep; n <= fleetMax; n += fleetStep {
		if !stage(n) {
			failed = n
			break
		}
		best = n
	}
	for failed > best+1 {
		n := (best + failed) / 2
		if stage(n) {
			best = n
		} else {
			failed = n
		}
	}
	if failed == 0 {
		b.Logf("fleet: kept up with the most engines tried (%d)", fleetMax)
	}
	perEngine := float64(updates) / float64(steps) * synthStepRate
	tps := s.pgbenchTPS(b)
	if prefix == "fleet" {
		b.ReportMetric(float64(best), "engines")
		b.ReportMetric(tps/perEngine, "baseline_engines")
	} else {
		b.ReportMetric(tps/perEngine, "pgbench_engines")
	}
	b.ReportMetric(perEngine, "updates/s/engine")
	b.ReportMetric(perEngine*float64(best), "updates/s")
	b.ReportMetric(tps, "pgbench_tps")
	return best
}

// slope is the least-squares slope of the points xy takes from samples (0
// with fewer than two).
func slope[T any](samples []T, xy func(T) (float64, float64)) float64 {
	if len(samples) < 2 {
		return 0
	}
	var sx, sy, sxx, sxy float64
	for _, sm := range samples {
		x, y := xy(sm)
		sx, sy, sxx, sxy = sx+x, sy+y, sxx+x*x, sxy+x*y
	}
	n := float64(len(samples))
	d := n*sxx - sx*sx
	if d == 0 {
		return 0
	}
	return (n*sxy - sx*sy) / d
}

// engineIDs returns n engine ids, the i-th (counting from first) on
// partition i mod partitions of the engine-steps topic under the
// producers' key balancer, so that engines spread evenly over the
// scheduler's consumers.
func engineIDs(prefix string, partitions, first, n int) []string {
	parts := make([]int, partitions)
	for i := range parts {
		parts[i] = i
	}
	var bal kafka.Murmur2Balancer
	out := make([]string, 0, n)
	for i := first; i < first+n; i++ {
		for k := 0; ; k++ {
			id := fmt.Sprintf("%s-e%d-%d", prefix, i, k)
			if bal.Balance(kafka.Message{Key: []byte(id)}, parts...) == i%len(parts) {
				out = append(out, id)
				break
			}
		}
	}
	return out
}

// synthEngine is a synthetic engine as vLLM's scheduler runs one, reduced
// to what it publishes: it keeps synthRunning requests running; each step
// gives every prefilling request up to synthChunk tokens of a budget of
// synthBudget prefill tokens, every decoding request one token (a decode
// event when it needs a new block, every 16 tokens), finishes the requests
// that generated their output, and admits new ones in their place while
// the budget lasts (admitted with the full hash chain, allocated, and
// scheduled new with their first chunk), all in one step's events. Output
// lengths are drawn around synthRunning·prompt/synthBudget tokens, the
// turnover the budget sustains with every slot kept busy.
type synthEngine struct {
	id, model string
	prompt    int
	meanOut   int
	rng       *rand.Rand
	steps     int64
	running   []*synthReq
	next      int
	free      []kvcore.BlockID
	top       kvcore.BlockID
	// lastID is the id of the last step record encoded.
	lastID string
}

// synthReq is one request of a synthEngine.
type synthReq struct {
	id       string
	seq      int64
	tokens   int // computed
	out, gen int // output tokens to generate, generated
	consumer bool
	blocks   []kvcore.BlockID
}

func newSynthEngine(id, model string, prompt int, seed uint64) *synthEngine {
	return &synthEngine{id: id, model: model, prompt: prompt, meanOut: max(synthRunning*prompt/synthBudget, 2),
		rng: rand.New(rand.NewPCG(seed, 0x6b766d657368))}
}

// fill admits synthRunning requests with their whole prompt scheduled at
// once, each already part-way through its output as in the steady state
// (the requests running at a moment have length-biased outputs, a uniform
// share of each generated), so that requests finish at the steady rate
// from the first step. They are kv_consumer requests, which never save: a
// fill is set-up, and its saves (a whole prompt each) would only make it
// slower; from then on they only decode and finish.
func (e *synthEngine) fill() []contract.RequestEvent {
	var evs []contract.RequestEvent
	lo, hi := float64(e.meanOut)/2, float64(e.meanOut)*3/2
	for len(e.running) < synthRunning {
		r := e.request()
		r.out = max(int(math.Sqrt(lo*lo+e.rng.Float64()*(hi*hi-lo*lo))), 1)
		r.gen = e.rng.IntN(r.out)
		r.consumer = true
		evs = e.admit(evs, r, e.prompt)
	}
	return evs
}

// step runs one engine step and returns its request events.
func (e *synthEngine) step() []contract.RequestEvent {
	budget := synthBudget
	var evs []contract.RequestEvent
	kept := e.running[:0]
	for _, r := range e.running {
		if r.tokens < e.prompt {
			if n := min(e.prompt-r.tokens, synthChunk, budget); n > 0 {
				budget -= n
				r.tokens += n
				evs = append(evs, e.event(r, contract.RequestEvent{Kind: contract.EventScheduled,
					Step: &kvcore.Step{Kind: kvcore.StepRunning, Tokens: r.tokens, Table: kvcore.BlockTable{e.grow(r)}}}))
			}
			kept = append(kept, r)
			continue
		}
		r.tokens++
		r.gen++
		if added := e.grow(r); len(added) > 0 {
			evs = append(evs, e.event(r, contract.RequestEvent{Kind: contract.EventScheduled,
				Step: &kvcore.Step{Kind: kvcore.StepDecode, Tokens: r.tokens, Table: kvcore.BlockTable{added}}}))
		}
		if r.gen >= r.out {
			evs = append(evs, e.event(r, contract.RequestEvent{Kind: contract.EventFinished}))
			e.free = append(e.free, r.blocks...)
			continue
		}
		kept = append(kept, r)
	}
	clear(e.running[len(kept):])
	e.running = kept
	for len(e.running) < synthRunning && budget > 0 {
		n := min(e.prompt, synthChunk, budget)
		budget -= n
		evs = e.admit(evs, e.request(), n)
	}
	return evs
}

// request starts a new request (not yet running).
func (e *synthEngine) request() *synthReq {
	e.next++
	return &synthReq{id: "r" + strconv.Itoa(e.next), out: e.meanOut/2 + e.rng.IntN(e.meanOut+1)}
}

// admit appends r's admitted, allocated and new events with its first n
// tokens scheduled, and runs it.
func (e *synthEngine) admit(evs []contract.RequestEvent, r *synthReq, n int) []contract.RequestEvent {
	r.tokens = n
	table := kvcore.BlockTable{e.grow(r)}
	e.running = append(e.running, r)
	return append(evs,
		e.event(r, contract.RequestEvent{Kind: contract.EventAdmitted, PromptTokens: e.prompt, BlockHashes: e.chain(), Consumer: r.consumer}),
		e.event(r, contract.RequestEvent{Kind: contract.EventAllocated, BlockTable: table}),
		e.event(r, contract.RequestEvent{Kind: contract.EventScheduled, Step: &kvcore.Step{Kind: kvcore.StepNew, Tokens: n, Table: table}}))
}

// event numbers ev as r's next event.
func (e *synthEngine) event(r *synthReq, ev contract.RequestEvent) contract.RequestEvent {
	r.seq++
	ev.RequestID, ev.Seq = r.id, r.seq
	return ev
}

// grow gives r the blocks its tokens need and returns the new ones.
func (e *synthEngine) grow(r *synthReq) []kvcore.BlockID {
	from := len(r.blocks)
	for len(r.blocks)*synthBlock < r.tokens {
		id := e.top
		if n := len(e.free); n > 0 {
			id, e.free = e.free[n-1], e.free[:n-1]
		} else {
			e.top++
		}
		r.blocks = append(r.blocks, id)
	}
	return slices.Clone(r.blocks[from:])
}

// chain is a fresh hash chain of the prompt: prompt/16 random 64-digit hex
// hashes (as incompressible as real ones).
func (e *synthEngine) chain() []string {
	out := make([]string, e.prompt/synthBlock)
	var raw [32]byte
	for i := range out {
		for j := 0; j < len(raw); j += 8 {
			v := e.rng.Uint64()
			for k := range 8 {
				raw[j+k] = byte(v >> (8 * k))
			}
		}
		out[i] = hex.EncodeToString(raw[:])
	}
	return out
}

// encode turns one step's events into its step records, split as an
// engine splits a step too large for one record.
func (e *synthEngine) encode(evs []contract.RequestEvent) []kafka.Message {
	e.steps++
	var parts [][]contract.RequestEvent
	start, size := 0, 0
	for i, ev := range evs {
		n := eventBytes(ev)
		if i > start && (i-start >= contract.MaxStepRequests || size+n > synthRecordBytes) {
			parts = append(parts, evs[start:i])
			start, size = i, 0
		}
		size += n
	}
	if start < len(evs) {
		parts = append(parts, evs[start:])
	}
	msgs := make([]kafka.Message, len(parts))
	for i, p := range parts {
		id := fmt.Sprintf("%s/%d", e.id, e.steps)
		if len(parts) > 1 {
			id = fmt.Sprintf("%s.%d", id, i+1)
		}
		v, err := json.Marshal(contract.EngineStep{Schema: contract.SchemaEngineStep, StepID: id, EngineID: e.id,
			Model: e.model, Step: e.steps, Requests: p})
		if err != nil {
			panic(err) // the contract types always encode
		}
		msgs[i] = kafka.Message{Topic: contract.TopicEngineSteps, Key: []byte(e.id), Value: v}
		e.lastID = id
	}
	return msgs
}

// eventBytes bounds the encoded size of one request event.
func eventBytes(ev contract.RequestEvent) int {
	n := 200 + 67*len(ev.BlockHashes)
	for _, g := range ev.BlockTable {
		n += 12 * len(g)
	}
	if ev.Step != nil {
		for _, g := range ev.Step.Table {
			n += 12 * len(g)
		}
	}
	return n
}
