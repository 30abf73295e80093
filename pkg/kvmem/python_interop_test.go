package kvmem_test

import (
	"bytes"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/kvmem"
)

// The Python twin of this package (connectors/vllm/kvmesh_vllm/kvmem.py)
// must agree with it byte for byte: these tests run its interop script
// (connectors/vllm/tests/interop/kvmem_interop.py) with Debian's Python.
// They skip when that Python cannot import numpy, and fail instead with
// KVMESH_REQUIRE_PYTHON=1.

// runInterop runs the interop script with args, stdin as its input, and
// decodes its JSON answer into out.
func runInterop(t *testing.T, stdin any, out any, args ...string) {
	t.Helper()
	testenv.RunInterop(t, "kvmem_interop.py", stdin, out, args...)
}

// pyHeld is a record's Held as the interop script dumps it.
type pyHeld struct {
	Hash       string `json:"hash"`
	RequestID  string `json:"request_id"`
	Generation uint64 `json:"generation"`
	Completed  int64  `json:"completed"`
	Writer     int    `json:"writer"`
}

// pyBlock is one block as the interop script dumps it.
type pyBlock struct {
	Seq    uint64  `json:"seq"`
	OK     bool    `json:"ok"`
	Held   *pyHeld `json:"held"`
	SHA256 string  `json:"sha256"`
}

// goBlock is what Go's side sees of (g, b), in the dump's form.
func goBlock(mem kvmem.Memory, g, b int) pyBlock {
	seq, h, ok := mem.Record(g, b).Load()
	out := pyBlock{Seq: seq, OK: ok}
	if ok && h.Hash != "" {
		out.Held = &pyHeld{Hash: h.Hash, RequestID: h.RequestID, Generation: h.Generation, Completed: h.Completed, Writer: int(h.Writer)}
	}
	sum := sha256.New()
	for _, r := range mem.Regions(g, b) {
		sum.Write(r)
	}
	out.SHA256 = hex.EncodeToString(sum.Sum(nil))
	return out
}

// compareDump checks that the Python side's dump is what Go sees, block
// for block.
func compareDump(t *testing.T, mem kvmem.Memory, dump [][]pyBlock) {
	t.Helper()
	l := mem.Layout()
	if len(dump) != len(l.Groups) {
		t.Fatalf("python dumped %d groups, the layout has %d", len(dump), len(l.Groups))
	}
	for g, gl := range l.Groups {
		if len(dump[g]) != gl.Blocks {
			t.Fatalf("group %d: python dumped %d blocks of %d", g, len(dump[g]), gl.Blocks)
		}
		for b := range gl.Blocks {
			if want := goBlock(mem, g, b); !reflect.DeepEqual(dump[g][b], want) {
				t.Errorf("group %d block %d: python sees %+v (held %+v), go %+v (held %+v)", g, b, dump[g][b], dump[g][b].Held, want, want.Held)
			}
		}
	}
}

// pattern is the test bytes of a block: byte j is seed + 7j + j>>8 (mod
// 256), as the interop script's pattern.
func pattern(seed, n int) []byte {
	out := make([]byte, n)
	for j := range out {
		out[j] = byte(seed + 7*j + j>>8)
	}
	return out
}

// interopLayouts are layouts of several groups and regions, some odd sized.
var interopLayouts = []kvmem.Layout{
	{Groups: []kvmem.GroupLayout{{Blocks: 4, Regions: []int64{64}}}},
	{Groups: []kvmem.GroupLayout{{Blocks: 3, Regions: []int64{16, 16, 32}}, {Blocks: 5, Regions: []int64{40}}}},
	{Groups: []kvmem.GroupLayout{{Blocks: 7, Regions: []int64{1000, 24, 4096}}, {Blocks: 2, Regions: []int64{73728}}, {Blocks: 9, Regions: []int64{3, 5}}}},
	{Groups: []kvmem.GroupLayout{{Blocks: 1, Regions: []int64{1}}}},
}

func TestPythonLayouts(t *testing.T) {
	invalid := []kvmem.Layout{
		{},
		{Groups: []kvmem.GroupLayout{{Blocks: 0, Regions: []int64{64}}}},
		{Groups: []kvmem.GroupLayout{{Blocks: 1<<24 + 1, Regions: []int64{64}}}},
		{Groups: []kvmem.GroupLayout{{Blocks: 4}}},
		{Groups: []kvmem.GroupLayout{{Blocks: 4, Regions: []int64{64, 0}}}},
		{Groups: []kvmem.GroupLayout{{Blocks: 4, Regions: []int64{1<<32 + 1}}}},
		{Groups: []kvmem.GroupLayout{{Blocks: 4, Regions: make([]int64, 800)}}}, // invalid before its size matters
	}
	// Valid, but its JSON does not fit the header: neither side makes a
	// segment of it.
	big := kvmem.Layout{Groups: []kvmem.GroupLayout{{Blocks: 4, Regions: make([]int64, 800)}}}
	for i := range big.Groups[0].Regions {
		big.Groups[0].Regions[i] = 1_000_000
	}
	// Valid at both bounds, but too large to make.
	huge := kvmem.Layout{Groups: []kvmem.GroupLayout{{Blocks: 1 << 24, Regions: []int64{1 << 32, 1}}}}
	all := append(append([]kvmem.Layout{big, huge}, interopLayouts...), invalid...)
	type query struct {
		Layout kvmem.Layout `json:"layout"`
		Create bool         `json:"create"`
	}
	queries := make([]query, len(all))
	for i, l := range all {
		queries[i] = query{Layout: l, Create: i != 1}
	}
	var ans struct {
		Layouts []struct {
			Valid   bool          `json:"valid"`
			JSON    string        `json:"json"`
			Offsets kvmem.Offsets `json:"offsets"`
			Header  string        `json:"header"`
			File    string        `json:"file"`
			Error   string        `json:"error"`
		} `json:"layouts"`
	}
	dir := t.TempDir()
	runInterop(t, queries, &ans, "layouts", dir)
	if len(ans.Layouts) != len(all) {
		t.Fatalf("%d answers for %d layouts", len(ans.Layouts), len(all))
	}
	for i, l := range all {
		got := ans.Layouts[i]
		if want := l.Validate() == nil; got.Valid != want {
			t.Errorf("layout %d: python valid %v (%s), go %v", i, got.Valid, got.Error, want)
			continue
		}
		if !got.Valid {
			continue
		}
		js, _ := json.Marshal(l)
		if got.JSON != string(js) {
			t.Errorf("layout %d: python JSON %s, go %s", i, got.JSON, js)
		}
		if want := l.Offsets(); !reflect.DeepEqual(got.Offsets, want) {
			t.Errorf("layout %d: python offsets %+v, go %+v", i, got.Offsets, want)
		}
		if !queries[i].Create {
			continue
		}
		// Go's header and fresh segment, from Create.
		path := filepath.Join(dir, "go.kvmem")
		seg, err := kvmem.Create(path, l)
		if errors.Is(err, kvmem.ErrLayout) {
			if got.Header != "" || got.File != "" || got.Error == "" {
				t.Errorf("layout %d: go cannot make its header (%v), python made %q", i, err, got.File)
			}
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		if err := seg.Close(); err != nil {
			t.Fatal(err)
		}
		goFile, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.Remove(path); err != nil {
			t.Fatal(err)
		}
		hdr, err := base64.StdEncoding.DecodeString(got.Header)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(hdr, goFile[:kvmem.HeaderSize]) {
			t.Errorf("layout %d: python's header differs from go's", i)
		}
		pyFile, err := os.ReadFile(got.File)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(pyFile, goFile) {
			t.Errorf("layout %d: python's fresh segment (%d bytes) differs from go's (%d bytes)", i, len(pyFile), len(goFile))
		}
		// Go opens the segment Python made.
		pseg, err := kvmem.Open(got.File, l)
		if err != nil {
			t.Errorf("layout %d: go cannot open python's segment: %v", i, err)
			continue
		}
		_ = pseg.Close()
	}
}

// TestPythonReadsGo: Go creates a segment and writes blocks through its
// EngineWriter (and leaves one gpuworker write unfinished); Python opens
// it and sees every record and byte as Go does, then recovers the
// unfinished write.
func TestPythonReadsGo(t *testing.T) {
	l := interopLayouts[2]
	path := filepath.Join(t.TempDir(), "go.kvmem")
	seg, err := kvmem.Create(path, l)
	if err != nil {
		t.Fatal(err)
	}
	defer seg.Remove()
	w := kvmem.NewEngineWriter(seg)
	long := strings.Repeat("r", kvmem.RecordRequestIDLen+40)
	writes := []struct {
		group, block int
		id           dataplane.Identity
	}{
		{0, 0, dataplane.Identity{Hash: strings.Repeat("ab", 32), RequestID: "req-1"}},
		{0, 6, dataplane.Identity{Hash: "0f", RequestID: long}},
		{1, 1, dataplane.Identity{Hash: strings.Repeat("c", dataplane.MaxHashLen)}},
		{2, 4, dataplane.Identity{Hash: "1234567", RequestID: "odd-length-hash"}},
		{2, 4, dataplane.Identity{Hash: "89abcdef", RequestID: "rewritten"}},
		{2, 8, dataplane.Identity{Hash: "dead", RequestID: "to-evict"}},
	}
	for i, wr := range writes {
		data := pattern(i+1, int(l.Groups[wr.group].BlockBytes()))
		if err := w.WriteBytes(wr.group, wr.block, wr.id, data); err != nil {
			t.Fatal(err)
		}
	}
	if held, err := w.Evict(2, 8); err != nil || !held {
		t.Fatalf("Evict = %v, %v", held, err)
	}
	failed := errors.New("fill failed")
	if err := w.Write(0, 3, dataplane.Identity{Hash: "aa"}, func(segs [][]byte) error { segs[0][0] = 1; return failed }); !errors.Is(err, failed) {
		t.Fatalf("failed Write = %v", err)
	}
	// A gpuworker load that died mid-write, and one engine write in progress.
	if _, err := seg.Record(1, 0).Begin(kvmem.WriterWorker); err != nil {
		t.Fatal(err)
	}
	engineSeq, err := seg.Record(2, 0).Begin(kvmem.WriterEngine)
	if err != nil {
		t.Fatal(err)
	}

	var ans struct {
		Layout     string      `json:"layout"`
		Size       int64       `json:"size"`
		Blocks     [][]pyBlock `json:"blocks"`
		FileSHA256 string      `json:"file_sha256"`
		Recovered  int         `json:"recovered"`
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	runInterop(t, nil, &ans, "read", path, "--recover")
	js, _ := json.Marshal(l)
	if ans.Layout != string(js) || ans.Size != l.Offsets().Size {
		t.Errorf("python read layout %s of %d bytes, want %s of %d", ans.Layout, ans.Size, js, l.Offsets().Size)
	}
	if sum := sha256.Sum256(want); ans.FileSHA256 != hex.EncodeToString(sum[:]) {
		t.Error("python read other file bytes than go wrote")
	}
	// The dump was taken before the recovery: the two odd records are
	// checked by hand, as Go now sees one of them recovered.
	if b := ans.Blocks[1][0]; b.OK || b.Seq != 1 {
		t.Errorf("group 1 block 0 mid-write: python saw %+v", b)
	}
	if b := ans.Blocks[2][0]; b.OK || b.Seq != engineSeq {
		t.Errorf("group 2 block 0 mid-write: python saw %+v", b)
	}
	if ans.Recovered != 1 {
		t.Errorf("python recovered %d worker writes, want 1", ans.Recovered)
	}
	if seq, h, ok := seg.Record(1, 0).Load(); !ok || seq != 2 || h.Hash != "" {
		t.Errorf("after python's recovery go sees group 1 block 0 as seq %d ok %v %+v", seq, ok, h)
	}
	if seq := seg.Record(2, 0).Seq(); seq != engineSeq {
		t.Errorf("python's recovery touched an engine write: seq %d, want %d", seq, engineSeq)
	}
	seg.Record(2, 0).Abort(engineSeq)
	// Their bytes are compared; their records were checked above.
	for _, c := range []struct{ g, b int }{{1, 0}, {2, 0}} {
		now := goBlock(seg, c.g, c.b)
		now.SHA256 = ans.Blocks[c.g][c.b].SHA256
		ans.Blocks[c.g][c.b] = now
	}
	compareDump(t, seg, ans.Blocks)
	// Spot checks that the dump holds what was written.
	if h := ans.Blocks[0][6].Held; h == nil || h.RequestID != long[:kvmem.RecordRequestIDLen] || h.Hash != "0f" {
		t.Errorf("group 0 block 6: python saw %+v", h)
	}
	if h := ans.Blocks[2][4].Held; h == nil || h.Hash != "89abcdef" || h.Writer != int(kvmem.WriterEngine) {
		t.Errorf("group 2 block 4: python saw %+v", h)
	}
	if ans.Blocks[2][8].Held != nil || ans.Blocks[0][3].Held != nil {
		t.Error("python sees an evicted or failed block as held")
	}
}

// TestGoReadsPython: Python creates a segment and writes it through its
// EngineWriter (whole blocks, blocks by region, one failed write, one
// eviction); Go maps it the way the gpuworker does on registration
// (decoding the registration body, then kvmem.Open) and sees every record
// and byte Python reported.
func TestGoReadsPython(t *testing.T) {
	l := interopLayouts[1]
	path := filepath.Join(t.TempDir(), "py.kvmem")
	long := strings.Repeat("x", kvmem.RecordRequestIDLen+1)
	type op struct {
		Op        string `json:"op"`
		Group     int    `json:"group"`
		Block     int    `json:"block"`
		Hash      string `json:"hash"`
		RequestID string `json:"request_id"`
		Seed      int    `json:"seed"`
	}
	ops := []op{
		{"write", 0, 0, strings.Repeat("5a", 32), "req-a", 11},
		{"write_regions", 0, 2, "abcdef", long, 12},
		{"write", 1, 4, strings.Repeat("f", dataplane.MaxHashLen), "", 13},
		{"write", 1, 1, "01", "to-be-aborted", 14},
		{"abort", 1, 1, "02", "aborted", 0},
		{"write", 1, 3, "03", "to-be-evicted", 15},
		{"evict", 1, 3, "", "", 0},
		{"evict", 1, 0, "", "", 0},
		{"write", 0, 2, "0abc", "rewrite", 16},
	}
	var ans struct {
		Registration json.RawMessage `json:"registration"`
		Results      []struct {
			Op         string  `json:"op"`
			Generation *uint64 `json:"generation"`
			Raised     *bool   `json:"raised"`
			Evicted    *bool   `json:"evicted"`
		} `json:"results"`
		Blocks [][]pyBlock `json:"blocks"`
	}
	runInterop(t, map[string]any{"layout": l, "ops": ops}, &ans, "write", path)
	t.Cleanup(func() { _ = os.Remove(path) })

	var reg kvmem.Registration
	dec := json.NewDecoder(bytes.NewReader(ans.Registration))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&reg); err != nil {
		t.Fatalf("decode python's registration %s: %v", ans.Registration, err)
	}
	if reg.Kind != kvmem.KindShm || reg.Path != path || !reg.Layout.Equal(l) || len(reg.Handles) != 0 {
		t.Fatalf("python's registration %s", ans.Registration)
	}
	seg, err := kvmem.Open(reg.Path, reg.Layout)
	if err != nil {
		t.Fatalf("go cannot open python's segment: %v", err)
	}
	defer seg.Close()
	compareDump(t, seg, ans.Blocks)

	if len(ans.Results) != len(ops) {
		t.Fatalf("%d results for %d ops", len(ans.Results), len(ops))
	}
	var last uint64
	gens := map[[2]int]uint64{}
	for i, o := range ops {
		r := ans.Results[i]
		switch o.Op {
		case "write", "write_regions":
			if r.Generation == nil || *r.Generation <= last {
				t.Fatalf("op %d: generation %v after %d: not growing", i, r.Generation, last)
			}
			last = *r.Generation
			gens[[2]int{o.Group, o.Block}] = last
		case "abort":
			if r.Raised == nil || !*r.Raised {
				t.Errorf("op %d: the failed fill did not raise", i)
			}
		case "evict":
			if want := o.Block == 3; r.Evicted == nil || *r.Evicted != want {
				t.Errorf("op %d: evicted %v, want %v", i, r.Evicted, want)
			}
		}
	}
	// What Go's side sees, checked against the ops.
	held := map[[2]int]op{{0, 0}: ops[0], {1, 4}: ops[2], {0, 2}: ops[8]}
	for g, gl := range l.Groups {
		for b := range gl.Blocks {
			seq, h, ok := seg.Record(g, b).Load()
			if !ok || seq%2 != 0 {
				t.Errorf("group %d block %d: seq %d ok %v", g, b, seq, ok)
			}
			o, isHeld := held[[2]int{g, b}]
			if !isHeld {
				if h.Hash != "" {
					t.Errorf("group %d block %d holds %+v, want nothing", g, b, h)
				}
				continue
			}
			want := kvmem.Held{Hash: o.Hash, RequestID: o.RequestID[:min(len(o.RequestID), kvmem.RecordRequestIDLen)],
				Generation: gens[[2]int{g, b}], Completed: h.Completed, Writer: kvmem.WriterEngine}
			if h != want || h.Completed <= 0 {
				t.Errorf("group %d block %d holds %+v, want %+v", g, b, h, want)
			}
			var got []byte
			for _, r := range seg.Regions(g, b) {
				got = append(got, r...)
			}
			if !bytes.Equal(got, pattern(o.Seed, int(gl.BlockBytes()))) {
				t.Errorf("group %d block %d: bytes differ from what python wrote", g, b)
			}
		}
	}
	// Sequences: two writes of (0,2), an aborted write of (1,1) after its
	// write, an evicted (1,3), an evicted never-written (1,0).
	for _, c := range []struct{ g, b int }{{0, 2}, {1, 1}, {1, 3}} {
		if seq := seg.Record(c.g, c.b).Seq(); seq != 4 {
			t.Errorf("group %d block %d: seq %d, want 4", c.g, c.b, seq)
		}
	}
	if seq := seg.Record(1, 0).Seq(); seq != 2 {
		t.Errorf("group 1 block 0: seq %d, want 2", seq)
	}
}

// TestPythonRecordBytes plays the same record operations with fixed
// generations and times on a Go and a Python segment: the files are equal
// byte for byte.
func TestPythonRecordBytes(t *testing.T) {
	l := interopLayouts[2]
	type op struct {
		Group      int    `json:"group"`
		Block      int    `json:"block"`
		Writer     int    `json:"writer"`
		Hash       string `json:"hash"`
		RequestID  string `json:"request_id"`
		Generation uint64 `json:"generation"`
		Completed  int64  `json:"completed"`
		Seed       int    `json:"seed"`
		Abort      bool   `json:"abort"`
	}
	ops := []op{
		{0, 0, 1, strings.Repeat("e3", 32), "req", 1<<63 + 5, 1_700_000_000_123_456_789, 1, false},
		{0, 0, 2, "1", strings.Repeat("long-id-", 30), 7, -1, 2, false}, // a rewrite over longer text leaves stale words
		{0, 5, 1, "abc", "aborted", 8, 9, 3, true},
		{1, 1, 2, strings.Repeat("9", dataplane.MaxHashLen), "é-unicode", 1<<64 - 1, 1, 4, false},
		{2, 8, 1, "ff", "", 0, 0, 5, false},
		{2, 8, 1, "fe", "", 0, 0, 6, true},
	}
	dir := t.TempDir()
	goPath, pyPath := filepath.Join(dir, "go.kvmem"), filepath.Join(dir, "py.kvmem")
	seg, err := kvmem.Create(goPath, l)
	if err != nil {
		t.Fatal(err)
	}
	for _, o := range ops {
		rec := seg.Record(o.Group, o.Block)
		seq, err := rec.Begin(kvmem.Writer(o.Writer))
		if err != nil {
			t.Fatal(err)
		}
		data := pattern(o.Seed, int(l.Groups[o.Group].BlockBytes()))
		at := 0
		for _, r := range seg.Regions(o.Group, o.Block) {
			at += copy(r, data[at:])
		}
		if o.Abort {
			rec.Abort(seq)
			continue
		}
		if err := rec.Commit(seq, kvmem.Held{Hash: o.Hash, RequestID: o.RequestID, Generation: o.Generation, Completed: o.Completed, Writer: kvmem.Writer(o.Writer)}); err != nil {
			t.Fatal(err)
		}
	}
	if err := seg.Close(); err != nil {
		t.Fatal(err)
	}
	var ans struct {
		Blocks [][]pyBlock `json:"blocks"`
	}
	runInterop(t, map[string]any{"layout": l, "ops": ops}, &ans, "replay", pyPath)
	goFile, err := os.ReadFile(goPath)
	if err != nil {
		t.Fatal(err)
	}
	pyFile, err := os.ReadFile(pyPath)
	if err != nil {
		t.Fatal(err)
	}
	if len(goFile) != len(pyFile) {
		t.Fatalf("go's segment is %d bytes, python's %d", len(goFile), len(pyFile))
	}
	for i := range goFile {
		if goFile[i] != pyFile[i] {
			t.Fatalf("segments differ first at byte %d (go %#x, python %#x)", i, goFile[i], pyFile[i])
		}
	}
	if h := ans.Blocks[1][1].Held; h == nil || h.Generation != 1<<64-1 || h.RequestID != "é-unicode" {
		t.Errorf("python loaded group 1 block 1 as %+v", h)
	}
	if h := ans.Blocks[0][0].Held; h == nil || h.Completed != -1 || h.Hash != "1" || h.Writer != int(kvmem.WriterWorker) {
		t.Errorf("python loaded group 0 block 0 as %+v", h)
	}
}

// TestPythonWriterSeqlock races the Python engine writer (plain aligned
// stores, no compare-and-swap) rewriting a block of a real segment against
// a Go reader here following the gpuworker's protocol (Load, copy the
// regions out, Unchanged): every copy the protocol accepts must be
// exactly the bytes of the hash the record held.
func TestPythonWriterSeqlock(t *testing.T) {
	if testing.Short() {
		t.Skip("spawns a python writer process")
	}
	l := kvmem.Layout{Groups: []kvmem.GroupLayout{{Blocks: 1, Regions: []int64{32 << 10, 32 << 10}}}}
	path := filepath.Join(t.TempDir(), "stress.kvmem")
	seg, err := kvmem.Create(path, l)
	if err != nil {
		t.Fatal(err)
	}
	defer seg.Remove()
	n := int(l.Groups[0].BlockBytes())
	want := map[string][]byte{}
	for k := 1; k <= 5; k++ {
		want[strings.Repeat("0", 63)+string(rune('0'+k))] = pattern(k, n)
	}
	cmd := testenv.PythonCommand(t, filepath.Join(testenv.ConnectorDir(t), "tests", "interop", "kvmem_interop.py"), "stress", path, "4000")
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	accepted, refused, torn := kvmem.ReadWhileWriting(t, seg, cmd, &out, want, "the python writer")
	var ans struct {
		Written int `json:"written"`
		Evicted int `json:"evicted"`
	}
	if err := json.Unmarshal(out.Bytes(), &ans); err != nil || ans.Written+ans.Evicted != 4000 {
		t.Fatalf("python writer answered %q (%v)", out.String(), err)
	}
	t.Logf("accepted %d copies, refused %d, of which %d torn (caught by the second check)", accepted, refused, torn)
	if accepted == 0 {
		t.Fatal("no copy was ever accepted: the test exercised nothing")
	}
	if seq, _, ok := seg.Record(0, 0).Load(); !ok || seq != 2*4000 {
		t.Fatalf("after the writer: seq %d ok %v, want %d", seq, ok, 2*4000)
	}
}
