package kvmem

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// holderEnv hands TestHolderProcess its segment.
const holderEnv = "KVMEM_TEST_HOLDER_SEGMENT"

var livenessLayout = Layout{Groups: []GroupLayout{{Blocks: 2, Regions: []int64{64}}}}

// shmSegment creates a segment in ShmDir (tmpfs, where the simulator makes
// them), removed when the test ends.
func shmSegment(t *testing.T) *Segment {
	t.Helper()
	path := filepath.Join(ShmDir(), fmt.Sprintf("kvmem-test-%d-%s.kvmem", os.Getpid(), strings.ReplaceAll(t.Name(), "/", "_")))
	seg, err := Create(path, livenessLayout)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = seg.Remove() })
	return seg
}

// mapped is seg.Mapped, failing t on an error.
func mapped(t *testing.T, seg *Segment) bool {
	t.Helper()
	ok, err := seg.Mapped()
	if err != nil {
		t.Fatalf("Mapped: %v", err)
	}
	return ok
}

// TestMappedFollowsOpen: a segment nobody opened is not mapped; it is
// while an Open of it (a second descriptor, as a gpuworker's) is open,
// and two Opens at once (a registration repeated) both hold it and
// neither blocks; after the last Close it is not mapped again. Probing
// takes nothing from the holders.
func TestMappedFollowsOpen(t *testing.T) {
	seg := shmSegment(t)
	if mapped(t, seg) {
		t.Fatal("a segment nobody opened is mapped")
	}
	a, err := Open(seg.Path(), livenessLayout)
	if err != nil {
		t.Fatal(err)
	}
	if !mapped(t, seg) || !mapped(t, seg) {
		t.Fatal("not mapped while an Open holds it")
	}
	b, err := Open(seg.Path(), livenessLayout)
	if err != nil {
		t.Fatalf("a second Open of the same segment: %v", err)
	}
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	if !mapped(t, seg) {
		t.Fatal("not mapped while the second Open holds it, after the first closed")
	}
	if _, err := b.Mapped(); !errors.Is(err, ErrSegment) {
		t.Fatalf("Mapped on an opened segment = %v, want ErrSegment (it holds its own lock)", err)
	}
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	if mapped(t, seg) {
		t.Fatal("mapped after every Open closed")
	}
	if err := b.Close(); err != nil {
		t.Fatalf("a second Close: %v", err)
	}
	if err := seg.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := seg.Mapped(); !errors.Is(err, ErrSegment) {
		t.Fatalf("Mapped after Close = %v, want ErrSegment", err)
	}
}

// TestOpenWaitsOutTheProbe: an Open racing the creator's probes (each an
// exclusive lock held for an instant) always gets its shared lock, and
// every probe after it sees the segment mapped.
func TestOpenWaitsOutTheProbe(t *testing.T) {
	seg := shmSegment(t)
	stop := make(chan struct{})
	probed := make(chan error, 1)
	go func() {
		for {
			select {
			case <-stop:
				probed <- nil
				return
			default:
			}
			if _, err := seg.Mapped(); err != nil {
				probed <- err
				return
			}
		}
	}()
	for range 200 {
		peer, err := Open(seg.Path(), livenessLayout)
		if err != nil {
			t.Fatalf("Open while probed: %v", err)
		}
		if !mapped(t, seg) {
			t.Fatal("not mapped after Open returned")
		}
		if err := peer.Close(); err != nil {
			t.Fatal(err)
		}
	}
	close(stop)
	if err := <-probed; err != nil {
		t.Fatal(err)
	}
}

// TestOpenRefusesAnExclusiveHolder: a file another descriptor keeps
// locked exclusively is refused once the wait is over, rather than hanging
// the registration.
func TestOpenRefusesAnExclusiveHolder(t *testing.T) {
	seg := shmSegment(t)
	hold, err := os.OpenFile(seg.Path(), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer hold.Close()
	if err := unix.Flock(int(hold.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		t.Fatalf("flock: %v", err)
	}
	f, err := os.OpenFile(seg.Path(), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := lockShared(f, 20*time.Millisecond); !errors.Is(err, ErrSegment) {
		t.Fatalf("a shared lock under another descriptor's exclusive one = %v, want ErrSegment", err)
	}
	if !mapped(t, seg) {
		t.Fatal("not mapped while another descriptor holds an exclusive lock")
	}
	if err := hold.Close(); err != nil {
		t.Fatal(err)
	}
	if err := lockShared(f, 0); err != nil {
		t.Fatalf("a shared lock once the exclusive one went: %v", err)
	}
}

// TestHolderProcess is the gpuworker of TestMappedAfterTheHolderDies, run
// as a child process: it opens the segment, says so, and waits to be
// killed.
func TestHolderProcess(t *testing.T) {
	path := os.Getenv(holderEnv)
	if path == "" {
		t.Skip("the holder process of TestMappedAfterTheHolderDies")
	}
	if _, err := Open(path, livenessLayout); err != nil {
		t.Fatal(err)
	}
	fmt.Println("opened")
	select {} // until killed
}

// TestMappedAfterTheHolderDies: a process that opened the segment and is
// killed (SIGKILL: it closes nothing) holds it no more: the kernel
// released its lock.
func TestMappedAfterTheHolderDies(t *testing.T) {
	seg := shmSegment(t)
	cmd := exec.Command(os.Args[0], "-test.run=^TestHolderProcess$", "-test.count=1", "-test.timeout=5m")
	cmd.Env = append(os.Environ(), holderEnv+"="+seg.Path())
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	waited := false
	defer func() {
		if !waited {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
	}()
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil || strings.TrimSpace(line) != "opened" {
		t.Fatalf("the holder process said %q, %v", line, err)
	}
	if !mapped(t, seg) {
		t.Fatal("not mapped while the holder process has it open")
	}
	if err := cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	_ = cmd.Wait() // killed: the error is the signal
	waited = true
	// The lock goes as the process's descriptors close on exit; Wait
	// returned after that, so no polling should be needed, but allow for it.
	deadline := time.Now().Add(10 * time.Second)
	for mapped(t, seg) {
		if time.Now().After(deadline) {
			t.Fatal("still mapped 10 s after the holder process was killed")
		}
		time.Sleep(time.Millisecond)
	}
}
