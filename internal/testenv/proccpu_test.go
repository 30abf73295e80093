package testenv_test

import (
	"context"
	"os"
	"os/exec"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/internal/testenv"
)

// burn keeps one goroutine busy for d of wall time.
func burn(d time.Duration) {
	x := uint64(1)
	for end := time.Now().Add(d); time.Now().Before(end); {
		for range 10000 {
			x = x*6364136223846793005 + 1442695040888963407
		}
	}
	if x == 0 {
		panic("unreachable") // keeps the loop
	}
}

// TestSelfCPUGrowsWithWork: the process's CPU time grows while one of its
// goroutines burns CPU. It burns in 50 ms slices until the growth shows,
// under a deadline: on a machine shared many ways (make test runs four
// test processes on two cores) a slice of wall time buys less CPU, never
// none; a SelfCPU that did not move fails at the deadline.
func TestSelfCPUGrowsWithWork(t *testing.T) {
	before, err := testenv.SelfCPU()
	if err != nil {
		t.Fatal(err)
	}
	after, deadline := before, time.Now().Add(30*time.Second)
	for after-before < 100*time.Millisecond && time.Now().Before(deadline) {
		burn(50 * time.Millisecond)
		if after, err = testenv.SelfCPU(); err != nil {
			t.Fatal(err)
		}
	}
	if got := after - before; got < 100*time.Millisecond {
		t.Fatalf("self CPU grew %v while burning for 30 s", got)
	}
	pid, err := testenv.ProcessCPU(os.Getpid())
	if err != nil || pid < after {
		t.Fatalf("ProcessCPU(self) = %v, %v; SelfCPU said %v before", pid, err, after)
	}
}

func TestProcessFamilyCPUCountsExitedChildren(t *testing.T) {
	before, err := testenv.ProcessFamilyCPU(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	// A child that burns CPU and exits (waited for) lands in cutime/cstime.
	cmd := exec.Command("sh", "-c", "i=0; while [ $i -lt 200000 ]; do i=$((i+1)); done")
	start := time.Now()
	if err := cmd.Run(); err != nil {
		t.Skipf("no sh: %v", err)
	}
	child := cmd.ProcessState.UserTime() + cmd.ProcessState.SystemTime()
	after, err := testenv.ProcessFamilyCPU(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	if child < 50*time.Millisecond {
		t.Skipf("child used only %v in %v: too fast to see at 10 ms resolution", child, time.Since(start))
	}
	if got := after - before; got < child-20*time.Millisecond {
		t.Fatalf("family CPU grew %v; the child alone used %v", got, child)
	}
}

func TestMachineCPU(t *testing.T) {
	busy, total, err := testenv.MachineCPU()
	if err != nil {
		t.Fatal(err)
	}
	if busy <= 0 || total <= busy {
		t.Fatalf("busy %v, total %v", busy, total)
	}
}

func TestServerCPU(t *testing.T) {
	ctx := context.Background()
	pg, err := testenv.PostgresCPU(ctx, testenv.DatabaseURL(t))
	if err != nil {
		t.Fatal(err)
	}
	rd, err := testenv.RedisCPU(ctx, testenv.RedisURL(t))
	if err != nil {
		t.Fatal(err)
	}
	if pg <= 0 || rd <= 0 {
		t.Fatalf("PostgreSQL %v, Redis %v: running servers have used some CPU", pg, rd)
	}
	db, closeDB, err := testenv.PostgresDatabaseCPU(ctx, testenv.DatabaseURL(t))
	if err != nil {
		t.Fatal(err)
	}
	defer closeDB()
	before, err := db()
	if err != nil {
		t.Fatal(err)
	}
	// Work of this database's backends: its own reads, repeated.
	for range 200 {
		if _, err := db(); err != nil {
			t.Fatal(err)
		}
	}
	after, err := db()
	if err != nil {
		t.Fatal(err)
	}
	if after < before {
		t.Fatalf("database CPU went back from %v to %v", before, after)
	}
}
