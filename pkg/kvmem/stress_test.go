package kvmem

import (
	"bytes"
	"crypto/sha256"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/pkg/dataplane"
)

// writerEnv hands TestWriterProcess its segment.
const writerEnv = "KVMEM_TEST_WRITER_SEGMENT"

// The stress test's segment: one block of two 32 KiB regions.
var stressLayout = Layout{Groups: []GroupLayout{{Blocks: 1, Regions: []int64{32 << 10, 32 << 10}}}}

const stressWrites = 4000

// stressHash is the i-th of the hashes the writer cycles through.
func stressHash(i int) string { return fmt.Sprintf("%064x", i%5+1) }

// stressContent is the bytes a block holding hash h holds: a ChaCha8
// stream keyed by the hash, so bytes of another write are recognisable.
func stressContent(h string) []byte {
	out := make([]byte, stressLayout.Groups[0].BlockBytes())
	_, _ = rand.NewChaCha8(sha256.Sum256([]byte(h))).Read(out)
	return out
}

// TestWriterProcess is the engine of TestSeqlockAcrossProcesses, run as a
// child process: it rewrites the block over and over, computing each
// write's bytes first (outside the write, as an engine computes KV),
// evicting it now and then.
func TestWriterProcess(t *testing.T) {
	path := os.Getenv(writerEnv)
	if path == "" {
		t.Skip("the writer process of TestSeqlockAcrossProcesses")
	}
	seg, err := Open(path, stressLayout)
	if err != nil {
		t.Fatal(err)
	}
	defer seg.Close()
	w := NewEngineWriter(seg)
	for i := range stressWrites {
		if i%13 == 0 {
			if _, err := w.Evict(0, 0); err != nil {
				t.Fatal(err)
			}
			continue
		}
		h := stressHash(i)
		data := stressContent(h)
		if err := w.WriteBytes(0, 0, dataplane.Identity{Hash: h, RequestID: "w"}, data); err != nil {
			t.Fatal(err)
		}
	}
}

// TestSeqlockAcrossProcesses races a writer process rewriting a block of a
// real shared segment against a reader here that follows the reader's
// protocol (Load, copy the regions out, Unchanged): every copy the
// protocol accepts must be exactly the content of the hash the record
// held. The race detector cannot see this race (the mapping lies outside
// the Go heap, and it spans two processes): the check is the content
// itself. Copies whose second check failed are counted as torn when their
// bytes are wrong, showing the race was there to catch.
func TestSeqlockAcrossProcesses(t *testing.T) {
	if testing.Short() {
		t.Skip("spawns a writer process")
	}
	path := filepath.Join(t.TempDir(), "stress.kvmem")
	seg, err := Create(path, stressLayout)
	if err != nil {
		t.Fatal(err)
	}
	defer seg.Remove()
	want := map[string][]byte{}
	for i := range 5 {
		want[stressHash(i)] = stressContent(stressHash(i))
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestWriterProcess$", "-test.count=1")
	cmd.Env = append(os.Environ(), writerEnv+"="+path)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	accepted, refused, torn := readWhileWriting(t, seg, cmd, &out, want, "the writer process")
	t.Logf("accepted %d copies, refused %d, of which %d torn (caught by the second check)", accepted, refused, torn)
	if accepted == 0 {
		t.Fatal("no copy was ever accepted: the test exercised nothing")
	}
}

// readWhileWriting reads block (0, 0) of seg by the reader's protocol
// (Load, copy the regions out, Unchanged) until cmd, a started process
// rewriting it with the contents of want, exits (who names it in
// failures). Every copy the protocol accepts must be exactly the bytes of
// the hash its record held; refused copies whose bytes are wrong are
// counted torn. It fails t when the writer fails or runs past two minutes.
func readWhileWriting(t testing.TB, seg *Segment, cmd *exec.Cmd, out *bytes.Buffer, want map[string][]byte, who string) (accepted, refused, torn int) {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	buf := make([]byte, seg.Layout().Groups[0].BlockBytes())
	rec := seg.Record(0, 0)
	deadline := time.Now().Add(2 * time.Minute)
	for running := true; running; {
		select {
		case err := <-done:
			if err != nil {
				t.Fatalf("%s: %v\n%s", who, err, out.String())
			}
			running = false
		default:
		}
		if time.Now().After(deadline) {
			_ = cmd.Process.Kill()
			t.Fatalf("%s did not finish", who)
		}
		seq, h, ok := rec.Load()
		if !ok || h.Hash == "" {
			refused++
			continue
		}
		at := 0
		for _, r := range seg.Regions(0, 0) {
			at += copy(buf[at:], r)
		}
		if !rec.Unchanged(seq) {
			refused++
			if !bytes.Equal(buf, want[h.Hash]) {
				torn++
			}
			continue
		}
		accepted++
		if !bytes.Equal(buf, want[h.Hash]) {
			t.Fatalf("accepted a block whose bytes are not those of %q (the record it checked)", h.Hash)
		}
	}
	return accepted, refused, torn
}
