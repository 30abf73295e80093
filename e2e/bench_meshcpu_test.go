package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/kvmesh/kvmesh/internal/dbtest"
	"github.com/kvmesh/kvmesh/internal/sim"
	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
)

// meshCPUProfileDirEnv names a directory where BenchmarkMeshCPU has every
// service write a CPU profile of its run (KVMESH_CPU_PROFILE), one file
// per process, <sub-benchmark>-<process>.pprof.
const meshCPUProfileDirEnv = "KVMESH_BENCH_PROFILE_DIR"

// meshCPUSimTimeout bounds one simulator run of BenchmarkMeshCPU.
const meshCPUSimTimeout = 10 * time.Minute

// BenchmarkMeshCPU measures what the mesh costs per request: the CPU every
// process of the mesh spent (utime + stime from /proc) while the seed
// preset's workload ran at --rate 0, divided by its requests.
//
//   - tp1: the seed's model, chain and workload (300 requests) at TP1 —
//     one gpuworker per engine;
//   - tp8: the seed's own shape, TP8 — sixteen gpuworkers;
//   - pgbench_update: the baseline, the CPU of one pgbench single-row
//     UPDATE transaction (server and client) on the same PostgreSQL,
//     from the machine's total CPU (/proc/stat), since pgbench's backends
//     come and go.
//
// The mesh's processes are the services (subprocesses), PostgreSQL (the
// postmaster, its live backends and those that exited) and the broker:
// the benchmark's own process, which holds only the embedded broker while
// the simulator runs as a kvmesh sim subprocess. Redis and the simulator
// are reported beside it but are not the mesh's. Every process's share
// is a metric (<process>_ms/request); the run must be clean with no
// mismatched byte.
func BenchmarkMeshCPU(b *testing.B) {
	b.Run("pgbench_update", func(b *testing.B) {
		for range b.N {
			b.ReportMetric(pgbenchUpdateCPU(b), "ms/tx")
		}
	})
	b.Run("tp1", func(b *testing.B) { meshCPU(b, seedBenchModel) })
	b.Run("tp8", func(b *testing.B) { meshCPU(b, tp8Model) })
	b.Run("idle_tp8", func(b *testing.B) { meshIdleCPU(b, tp8Model) })
}

// meshIdleWindow is how long meshIdleCPU measures an idle stack.
const meshIdleWindow = 10 * time.Second

// meshIdleCPU reports the CPU each process of an idle stack of model
// spends per second (<process>_ms/s, and ms/s for the mesh): what
// heartbeats, long-polling fetches, relay polls and metrics cost with no
// request to serve, measured over meshIdleWindow after one simulator run
// has warmed every path.
func meshIdleCPU(b *testing.B, model string) {
	s := newStack(b, stackOptions{model: model, connectors: "pd,store", poolBlocks: 192})
	kvmesh := testenv.BuildBinary(b, "./cmd/kvmesh")
	runSimProcess(b, s, kvmesh)
	b.ResetTimer()
	for range b.N {
		before, start := s.cpu(b), time.Now()
		time.Sleep(meshIdleWindow) // the measurement window, not synchronisation
		d, secs := s.cpu(b).minus(before), time.Since(start).Seconds()
		var mesh time.Duration
		for name, v := range d {
			if name != "redis" {
				mesh += v
			}
			b.ReportMetric(float64(v)/float64(time.Millisecond)/secs, name+"_ms/s")
		}
		b.ReportMetric(float64(mesh)/float64(time.Millisecond)/secs, "ms/s")
	}
}

// meshCPU runs the seed workload b.N times on a fresh stack of model and
// reports the CPU per request of each process and of the mesh.
func meshCPU(b *testing.B, model string) {
	o := stackOptions{model: model, connectors: "pd,store", poolBlocks: 192}
	if dir := os.Getenv(meshCPUProfileDirEnv); dir != "" {
		o.processEnv = func(name string) []string {
			return []string{"KVMESH_CPU_PROFILE=" + filepath.Join(dir, strings.ReplaceAll(b.Name(), "/", "_")+"-"+name+".pprof")}
		}
	}
	s := newStack(b, o)
	kvmesh := testenv.BuildBinary(b, "./cmd/kvmesh")
	var total procCPU
	calls, xacts := map[string]int64{}, int64(0)
	requests := 0
	b.ResetTimer()
	for range b.N {
		before, callsBefore, xactsBefore := s.cpu(b), s.syscalls(b), s.transactions(b)
		rep, simCPU := runSimProcess(b, s, kvmesh)
		after, callsAfter, xactsAfter := s.cpu(b), s.syscalls(b), s.transactions(b)
		d := after.minus(before)
		d["simulator"] = simCPU
		total = total.plus(d)
		for k, v := range callsAfter {
			calls[k] += v - callsBefore[k]
		}
		xacts += xactsAfter - xactsBefore
		requests += rep.Requests.Total
	}
	b.StopTimer()
	perReq := func(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) / float64(requests) }
	var mesh time.Duration
	names := make([]string, 0, len(total))
	for name := range total {
		names = append(names, name)
	}
	slices.Sort(names)
	var table strings.Builder
	for _, name := range names {
		if name != "redis" && name != "simulator" {
			mesh += total[name]
		}
		b.ReportMetric(perReq(total[name]), name+"_ms/request")
		fmt.Fprintf(&table, "\n  %-12s %7.2f ms/request", name, perReq(total[name]))
	}
	b.ReportMetric(perReq(mesh), "ms/request")
	b.Logf("Kafka records per request: %s", recordsPerRequest(b, s, requests))
	var sc strings.Builder
	for _, name := range slices.Sorted(maps.Keys(calls)) {
		fmt.Fprintf(&sc, "%s %.1f, ", name, float64(calls[name])/float64(requests))
	}
	b.Logf("read/write syscalls per request: %sPostgreSQL transactions per request: %.1f", sc.String(), float64(xacts)/float64(requests))
	var allCalls int64
	for _, n := range calls {
		allCalls += n
	}
	b.ReportMetric(float64(allCalls)/float64(requests), "syscalls/request")
	b.ReportMetric(float64(xacts)/float64(requests), "pg_tx/request")
	b.Logf("CPU per request over %d requests (mesh: all but redis and the simulator):%s\n  %-12s %7.2f ms/request",
		requests, table.String(), "mesh", perReq(mesh))
}

// recordsPerRequest lists the records every kvmesh topic holds per
// request run (each sub-benchmark has a broker of its own).
func recordsPerRequest(b *testing.B, s *stack, requests int) string {
	b.Helper()
	lc := bus.NewLagCollector(s.brokers)
	defer lc.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	topics := contract.Topics
	n, err := lc.Lag(ctx, "kvmesh-bench-nobody", topics)
	if err != nil {
		b.Fatal(err)
	}
	var out strings.Builder
	var total int64
	for _, t := range topics {
		total += n[t]
		fmt.Fprintf(&out, "%s %.2f, ", strings.TrimPrefix(t, "kvmesh."), float64(n[t])/float64(requests))
	}
	fmt.Fprintf(&out, "all %.2f", float64(total)/float64(requests))
	return out.String()
}

// procCPU is CPU time by process group name.
type procCPU map[string]time.Duration

func (c procCPU) minus(o procCPU) procCPU {
	out := procCPU{}
	for k, v := range c {
		out[k] = v - o[k]
	}
	return out
}

func (c procCPU) plus(o procCPU) procCPU {
	out := procCPU{}
	for k, v := range c {
		out[k] = v
	}
	for k, v := range o {
		out[k] += v
	}
	return out
}

// cpu reads the CPU time so far of every process of the stack, grouped:
// each service (the gpuworkers together), postgres, redis, and the broker
// (this process).
func (s *stack) cpu(b *testing.B) procCPU {
	b.Helper()
	out := procCPU{}
	for _, name := range s.mesh.Procs.Names() {
		pid := s.mesh.Procs.Process(name).PID()
		if pid == 0 {
			b.Fatalf("%s is not running", name)
		}
		d, err := testenv.ProcessCPU(pid)
		if err != nil {
			b.Fatal(err)
		}
		group, _, _ := strings.Cut(name, "-")
		out[group] += d
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pg, err := testenv.PostgresCPU(ctx, s.mesh.DatabaseURL)
	if err != nil {
		b.Fatal(err)
	}
	rd, err := testenv.RedisCPU(ctx, s.redisURL)
	if err != nil {
		b.Fatal(err)
	}
	self, err := testenv.ProcessCPU(os.Getpid())
	if err != nil {
		b.Fatal(err)
	}
	out["postgres"], out["redis"], out["broker"] = pg, rd, self
	return out
}

// syscalls reads the read and write system calls so far of every service
// process and of the broker (this process), grouped as cpu groups them
// (/proc/<pid>/io: syscr + syscw).
func (s *stack) syscalls(b *testing.B) map[string]int64 {
	b.Helper()
	out := map[string]int64{}
	pids := map[string][]int{"broker": {os.Getpid()}}
	for _, name := range s.mesh.Procs.Names() {
		group, _, _ := strings.Cut(name, "-")
		pids[group] = append(pids[group], s.mesh.Procs.Process(name).PID())
	}
	for group, list := range pids {
		for _, pid := range list {
			data, err := os.ReadFile(fmt.Sprintf("/proc/%d/io", pid))
			if err != nil {
				b.Fatal(err)
			}
			for _, line := range strings.Split(string(data), "\n") {
				k, v, _ := strings.Cut(line, ": ")
				if k == "syscr" || k == "syscw" {
					n, err := strconv.ParseInt(v, 10, 64)
					if err != nil {
						b.Fatalf("/proc/%d/io: %q: %v", pid, line, err)
					}
					out[group] += n
				}
			}
		}
	}
	return out
}

// transactions is the count of transactions committed or rolled back so
// far in the stack's database (pg_stat_database; the statistics of a
// backend reach it within a second or so of its transactions).
func (s *stack) transactions(b *testing.B) int64 {
	b.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	conn, err := pgx.Connect(ctx, s.mesh.DatabaseURL)
	if err != nil {
		b.Fatal(err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	var n int64
	if err := conn.QueryRow(ctx, `SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = current_database()`).Scan(&n); err != nil {
		b.Fatal(err)
	}
	return n
}

// runSimProcess plays the seed preset at --rate 0 on s with the kvmesh
// CLI as a subprocess, so that its CPU is its own; it fails b unless the
// run was clean, and returns the report and the simulator's CPU.
func runSimProcess(b *testing.B, s *stack, kvmesh string) (*sim.Report, time.Duration) {
	b.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), meshCPUSimTimeout)
	defer cancel()
	args := []string{"sim", "--preset", "seed", "--model", s.model, "--rate", "0", "--json", "--progress", "off",
		"--lookup", strings.Join(s.urls("lookup"), ","), "--scheduler", strings.Join(s.urls("scheduler"), ","),
		"--sender", strings.Join(s.urls("sender"), ","),
		"--worker", strings.Join(s.workerURLs("gpuworker"), ","), "--prefill-worker", strings.Join(s.workerURLs("gpuworker-prefill"), ","),
		"--engine", decodeEngine, "--prefill-engine", prefillEngine,
		"--brokers", strings.Join(s.brokers, ","), "--redis", s.redisURL,
		"--request-timeout", "2m", "--settle-timeout", "1m"}
	cmd := exec.CommandContext(ctx, kvmesh, args...)
	cmd.Env = append(os.Environ(), s.mesh.Env...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		b.Fatalf("kvmesh sim: %v\n%s", err, tail(stderr.String(), 40))
	}
	var rep sim.Report
	if err := json.Unmarshal(stdout.Bytes(), &rep); err != nil {
		b.Fatalf("kvmesh sim report: %v\n%s", err, tail(stdout.String(), 20))
	}
	if !rep.OK || rep.Requests.Failed != 0 || rep.Verification.Mismatched != 0 || rep.Requests.Total == 0 {
		b.Fatalf("seed run not clean: %d of %d requests failed, %d blocks mismatched",
			rep.Requests.Failed, rep.Requests.Total, rep.Verification.Mismatched)
	}
	st := cmd.ProcessState
	return &rep, st.UserTime() + st.SystemTime()
}

// pgbenchTransactions is pgbench's count of processed transactions.
var pgbenchTransactions = regexp.MustCompile(`number of transactions actually processed: ([0-9]+)`)

// pgbenchUpdateCPU runs pgbench's single-row UPDATE (8 clients, 2 threads,
// prepared) for 5 s on a fresh pgbench database and returns the machine's
// CPU per transaction (ms).
func pgbenchUpdateCPU(b *testing.B) float64 {
	b.Helper()
	db := dbtest.NewDatabase(b)
	script := filepath.Join(b.TempDir(), "update.sql")
	if err := os.WriteFile(script, []byte("\\set aid random(1, 100000 * :scale)\nUPDATE pgbench_accounts SET abalance = abalance + 1 WHERE aid = :aid;\n"), 0o600); err != nil {
		b.Fatal(err)
	}
	if out, err := testenv.Pgbench(b, "-i", "-s", "10", "-q", "-I", "dtGvp", db); err != nil {
		b.Fatalf("pgbench -i: %v\n%s", err, out)
	}
	before, _, err := testenv.MachineCPU()
	if err != nil {
		b.Fatal(err)
	}
	out, err := testenv.Pgbench(b, "-n", "-c", "8", "-j", "2", "-T", "5", "-M", "prepared", "-f", script, db)
	if err != nil {
		b.Fatalf("pgbench: %v\n%s", err, out)
	}
	after, _, err := testenv.MachineCPU()
	if err != nil {
		b.Fatal(err)
	}
	m := pgbenchTransactions.FindStringSubmatch(out)
	if m == nil {
		b.Fatalf("pgbench printed no transaction count:\n%s", out)
	}
	n, err := strconv.Atoi(m[1])
	if err != nil || n == 0 {
		b.Fatalf("pgbench transactions %q: %v", m[1], err)
	}
	return float64(after-before) / float64(time.Millisecond) / float64(n)
}
