package testenv

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"
)

// The CPU time of processes, read from the kernel, for benchmarks that
// report CPU per byte: of the test's own process, of service subprocesses,
// of the PostgreSQL server and of the Redis server (all on this machine).

// clockTick is the unit of the times in /proc/<pid>/stat and /proc/stat:
// USER_HZ, which Linux fixes at 100 on every architecture kvmesh runs on
// (sysconf(_SC_CLK_TCK) is not reachable without cgo).
const clockTick = 10 * time.Millisecond

// errProcStat reports a /proc stat line that cannot be parsed.
var errProcStat = errors.New("unparsable /proc stat")

// procStat is what benchmarks need of /proc/<pid>/stat.
type procStat struct {
	ppid                         int
	utime, stime, cutime, cstime time.Duration
}

// readProcStat parses /proc/<pid>/stat (pid 0: /proc/self/stat).
func readProcStat(pid int) (procStat, error) {
	path := "/proc/self/stat"
	if pid != 0 {
		path = "/proc/" + strconv.Itoa(pid) + "/stat"
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return procStat{}, err
	}
	return parseProcStat(b)
}

// parseProcStat parses one /proc/<pid>/stat line. The command name (field 2)
// is in parentheses and may hold spaces and parentheses itself, so the
// fields are counted from the last ')'.
func parseProcStat(b []byte) (procStat, error) {
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return procStat{}, errProcStat
	}
	f := strings.Fields(string(b[i+1:])) // f[0] is field 3 (state)
	if len(f) < 15 {
		return procStat{}, errProcStat
	}
	var v [5]int64 // ppid (4), utime (14), stime (15), cutime (16), cstime (17)
	for k, field := range []int{4, 14, 15, 16, 17} {
		n, err := strconv.ParseInt(f[field-3], 10, 64)
		if err != nil {
			return procStat{}, fmt.Errorf("%w: field %d: %v", errProcStat, field, err)
		}
		v[k] = n
	}
	return procStat{ppid: int(v[0]), utime: time.Duration(v[1]) * clockTick, stime: time.Duration(v[2]) * clockTick,
		cutime: time.Duration(v[3]) * clockTick, cstime: time.Duration(v[4]) * clockTick}, nil
}

// ProcessCPU is the CPU time (user + system) process pid has used so far,
// all its threads together, without its children's. Resolution: 10 ms.
func ProcessCPU(pid int) (time.Duration, error) {
	s, err := readProcStat(pid)
	if err != nil {
		return 0, err
	}
	return s.utime + s.stime, nil
}

// SelfCPU is ProcessCPU of the calling process: every goroutine of the
// test binary, whatever runs in it (services started in process, an
// embedded broker, the test's own clients).
func SelfCPU() (time.Duration, error) { return ProcessCPU(0) }

// ProcessFamilyCPU is the CPU time of process pid, of its children that
// have exited and been waited for (cutime + cstime), and of its live
// children (their own user + system time): what a server that forks one
// process per connection or worker has used in all.
func ProcessFamilyCPU(pid int) (time.Duration, error) {
	s, err := readProcStat(pid)
	if err != nil {
		return 0, err
	}
	total := s.utime + s.stime + s.cutime + s.cstime
	children, err := childrenOf(pid)
	if err != nil {
		return 0, err
	}
	for _, child := range children {
		cs, err := readProcStat(child)
		if err != nil || cs.ppid != pid {
			continue // gone meanwhile (its pid perhaps reused)
		}
		total += cs.utime + cs.stime
	}
	return total, nil
}

// childrenOf lists the live children of pid: from the children files of
// its threads (/proc/<pid>/task/<tid>/children, cheap), else — a kernel
// built without them — by scanning every process's parent.
func childrenOf(pid int) ([]int, error) {
	files, err := filepath.Glob("/proc/" + strconv.Itoa(pid) + "/task/[0-9]*/children")
	if err != nil {
		return nil, err
	}
	var out []int
	if len(files) > 0 {
		for _, f := range files {
			b, err := os.ReadFile(f)
			if err != nil {
				continue // the thread exited
			}
			for _, field := range strings.Fields(string(b)) {
				if child, err := strconv.Atoi(field); err == nil {
					out = append(out, child)
				}
			}
		}
		return out, nil
	}
	dirs, err := filepath.Glob("/proc/[0-9]*")
	if err != nil {
		return nil, err
	}
	for _, d := range dirs {
		child, err := strconv.Atoi(filepath.Base(d))
		if err != nil || child == pid {
			continue
		}
		if cs, err := readProcStat(child); err == nil && cs.ppid == pid {
			out = append(out, child)
		}
	}
	return out, nil
}

// PostgresPID is the pid of the postmaster of the PostgreSQL server at
// databaseURL, which must run on this machine: the parent of the backend
// that serves a connection.
func PostgresPID(ctx context.Context, databaseURL string) (int, error) {
	conn, err := pgx.Connect(ctx, databaseURL)
	if err != nil {
		return 0, err
	}
	defer func() { _ = conn.Close(ctx) }()
	var backend int
	if err := conn.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&backend); err != nil {
		return 0, err
	}
	s, err := readProcStat(backend)
	if err != nil {
		return 0, fmt.Errorf("backend %d (is PostgreSQL on this machine?): %w", backend, err)
	}
	return s.ppid, nil
}

// PostgresCPU is the CPU time the whole PostgreSQL server at databaseURL
// has used: ProcessFamilyCPU of its postmaster (every backend and
// background process, the exited ones included). It counts every
// database's work, other tests' included. A benchmark sampling it often
// resolves the pid once (PostgresPID) and calls ProcessFamilyCPU.
func PostgresCPU(ctx context.Context, databaseURL string) (time.Duration, error) {
	pid, err := PostgresPID(ctx, databaseURL)
	if err != nil {
		return 0, err
	}
	return ProcessFamilyCPU(pid)
}

// PostgresDatabaseCPU returns a reader of the CPU time the backends of
// databaseURL's database have used (every connection to that database, its
// own included, live at the time of each read), and a function that closes
// its connection. Unlike PostgresCPU it leaves out other databases' work —
// other tests' on a shared server — and the server's shared background
// processes (WAL writer, checkpointer), and it misses a backend that exited
// between two reads; it suits benchmarks whose services keep their
// connections.
func PostgresDatabaseCPU(ctx context.Context, databaseURL string) (func() (time.Duration, error), func(), error) {
	conn, err := pgx.Connect(ctx, databaseURL)
	if err != nil {
		return nil, nil, err
	}
	read := func() (time.Duration, error) {
		rows, err := conn.Query(ctx, "SELECT pid FROM pg_stat_activity WHERE datname = current_database()")
		if err != nil {
			return 0, err
		}
		pids, err := pgx.CollectRows(rows, pgx.RowTo[int32])
		if err != nil {
			return 0, err
		}
		var total time.Duration
		for _, pid := range pids {
			d, err := ProcessCPU(int(pid))
			if err != nil {
				continue // exited meanwhile
			}
			total += d
		}
		return total, nil
	}
	return read, func() { _ = conn.Close(context.Background()) }, nil
}

// RedisPID is the pid of the Redis server c talks to (INFO server
// process_id), which must run on this machine for ProcessCPU to read it.
func RedisPID(ctx context.Context, c redis.UniversalClient) (int, error) {
	info, err := c.Info(ctx, "server").Result()
	if err != nil {
		return 0, err
	}
	v, ok := infoField(info, "process_id")
	if !ok {
		return 0, errors.New("INFO server has no process_id")
	}
	return strconv.Atoi(v)
}

// RedisCPU is the CPU time the Redis server at redisURL has used: its
// ProcessFamilyCPU (every thread, and forked children such as a BGSAVE).
// It counts every client's work, other tests' included.
func RedisCPU(ctx context.Context, redisURL string) (time.Duration, error) {
	opts, err := redis.ParseURL(redisURL)
	if err != nil {
		return 0, err
	}
	c := redis.NewClient(opts)
	defer func() { _ = c.Close() }()
	pid, err := RedisPID(ctx, c)
	if err != nil {
		return 0, err
	}
	return ProcessFamilyCPU(pid)
}

// infoField is the value of name in an INFO answer.
func infoField(info, name string) (string, bool) {
	for line := range strings.Lines(info) {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), name+":"); ok {
			return v, true
		}
	}
	return "", false
}

// MachineCPU is the CPU time of the whole machine from /proc/stat: busy
// (every state but idle and iowait) and total, summed over every CPU.
// Their deltas over an interval give the machine's load, to judge how
// contended a measurement was.
func MachineCPU() (busy, total time.Duration, err error) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, 0, err
	}
	line, _, _ := bytes.Cut(b, []byte("\n"))
	f := strings.Fields(string(line))
	if len(f) < 5 || f[0] != "cpu" {
		return 0, 0, errProcStat
	}
	for i, s := range f[1:min(len(f), 9)] { // guest and guest_nice are already in user and nice
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			return 0, 0, fmt.Errorf("%w: /proc/stat: %v", errProcStat, err)
		}
		d := time.Duration(n) * clockTick
		total += d
		if i != 3 && i != 4 { // idle, iowait
			busy += d
		}
	}
	return busy, total, nil
}

// CPUMeter reads the CPU time of a set of named processes together, as a
// benchmark that reports CPU per byte samples them around each timed part.
type CPUMeter map[string]func() (time.Duration, error)

// CPUReading is the CPU time of each process of a CPUMeter.
type CPUReading map[string]time.Duration

// Read reads every process of the meter.
func (m CPUMeter) Read() (CPUReading, error) {
	r := make(CPUReading, len(m))
	for name, read := range m {
		d, err := read()
		if err != nil {
			return nil, fmt.Errorf("cpu of %s: %w", name, err)
		}
		r[name] = d
	}
	return r, nil
}

// Add adds to r the CPU each process used from reading from to reading to.
func (r CPUReading) Add(from, to CPUReading) {
	for name, d := range to {
		r[name] += d - from[name]
	}
}

// Total is the sum over every process of r.
func (r CPUReading) Total() time.Duration {
	var t time.Duration
	for _, d := range r {
		t += d
	}
	return t
}

// PostgresCPUFunc resolves the postmaster of the server at databaseURL
// once and returns a reader of PostgresCPU for a CPUMeter.
func PostgresCPUFunc(ctx context.Context, databaseURL string) (func() (time.Duration, error), error) {
	pid, err := PostgresPID(ctx, databaseURL)
	if err != nil {
		return nil, err
	}
	return func() (time.Duration, error) { return ProcessFamilyCPU(pid) }, nil
}

// RedisCPUFunc resolves the Redis server at redisURL once and returns a
// reader of RedisCPU for a CPUMeter.
func RedisCPUFunc(ctx context.Context, redisURL string) (func() (time.Duration, error), error) {
	opts, err := redis.ParseURL(redisURL)
	if err != nil {
		return nil, err
	}
	c := redis.NewClient(opts)
	defer func() { _ = c.Close() }()
	pid, err := RedisPID(ctx, c)
	if err != nil {
		return nil, err
	}
	return func() (time.Duration, error) { return ProcessFamilyCPU(pid) }, nil
}

// ProcessCPUFunc is a reader of ProcessCPU(pid) for a CPUMeter.
func ProcessCPUFunc(pid int) func() (time.Duration, error) {
	return func() (time.Duration, error) { return ProcessCPU(pid) }
}
