package sending_test

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/kvmesh/kvmesh/internal/dbtest"
	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/deadletter"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
)

// mutations of a valid task, chosen by the fuzzer's op byte; op 0 feeds
// the raw bytes as the record.
var mutations = []func(t *kvcore.SaveTask, raw []byte, a, b int){
	func(t *kvcore.SaveTask, _ []byte, a, _ int) {
		t.BlockTable = t.BlockTable[:mod(a, len(t.BlockTable)+1)]
	},
	func(t *kvcore.SaveTask, _ []byte, a, b int) {
		g := t.BlockTable[mod(a, len(t.BlockTable))]
		if len(g) > 0 {
			g[mod(b, len(g))] = kvcore.BlockID(a ^ b)
		}
	},
	func(t *kvcore.SaveTask, _ []byte, a, b int) { t.Start, t.End = a%4096, b%4096 },
	func(t *kvcore.SaveTask, _ []byte, a, _ int) {
		t.BlockHashes = t.BlockHashes[:mod(a, len(t.BlockHashes)+1)]
	},
	func(t *kvcore.SaveTask, raw []byte, a, _ int) {
		t.BlockHashes[mod(a, len(t.BlockHashes))] = string(raw)
	},
	func(t *kvcore.SaveTask, raw []byte, _, _ int) { t.Model = string(raw) },
	func(t *kvcore.SaveTask, _ []byte, a, b int) {
		t.Groups = append(t.Groups, kvcore.GroupChunks{Group: a % 8, Chunks: []kvcore.Chunk{{Start: b % 256, End: b%256 + 16}}})
	},
	func(t *kvcore.SaveTask, raw []byte, _, _ int) { t.TaskID = string(raw) },
	func(t *kvcore.SaveTask, raw []byte, _, _ int) { t.EngineID = string(raw) },
	func(t *kvcore.SaveTask, _ []byte, _, _ int) { t.BlockTable = nil },
	func(t *kvcore.SaveTask, _ []byte, a, b int) {
		gc := &t.Groups[mod(a, len(t.Groups))]
		gc.Chunks = []kvcore.Chunk{{Start: b % 512, End: (b + a) % 512}}
	},
	func(t *kvcore.SaveTask, _ []byte, a, _ int) { t.Groups = t.Groups[:mod(a, len(t.Groups)+1)] },
}

func mod(a, n int) int {
	if n == 0 {
		return 0
	}
	return (a%n + n) % n
}

// FuzzSenderHandler feeds random records and mutated valid save tasks
// through the handler, with a real PostgreSQL (once per process) and an
// in-memory store. The handler must never fail or panic, and every record
// must end accounted: a whole-record dead letter (undecodable), or its
// task's outcome, in which every model group is stored, existing, skipped,
// failed or dead-lettered and every dead letter names a group it counts.
func FuzzSenderHandler(f *testing.F) {
	pool := dbtest.NewPool(f) // skips without KVMESH_DATABASE_URL
	fx := newFixture(f, pool, kvstore.NewMemory(kvstore.MemoryOptions{CapacityBytes: 16 << 20}))
	f.Add([]byte(`{}`), uint8(0), 0, 0)
	f.Add([]byte("\xff\x00garbage"), uint8(0), 0, 0)
	f.Add([]byte(`{"task_id":"x","engine_id":"e1","request_id":"r"}`), uint8(0), 0, 0)
	f.Add([]byte(nil), uint8(1), 1, 0) // the seed's crash input: a 1-group table
	for op := range len(mutations) + 2 {
		f.Add([]byte("ab\x00"), uint8(op), 3, 17)
	}
	var n int
	f.Fuzz(func(t *testing.T, raw []byte, op uint8, a, b int) {
		n++
		value := raw
		if op > 0 {
			task := saveTask(fx.model, "fz"+string(rune('a'+n%26))+itoa(n), 0, 16*(1+mod(a, 4)), kvcore.BlockID(mod(b, 48)))
			if i := int(op) - 1; i < len(mutations) {
				mutations[i](task, raw, a, b)
			}
			value = encode(t, task)
		}
		rec := fx.record(value)
		fx.deliver(t, rec)
		checkAccounted(t, fx, rec)
	})
}

func itoa(n int) string {
	b, _ := json.Marshal(n)
	return string(b)
}

// checkAccounted fails unless rec ended stored, skipped or dead-lettered.
func checkAccounted(t *testing.T, fx *fixture, rec bus.Received) {
	t.Helper()
	dls := fx.deadLetters(t, rec.Offset)
	for _, d := range dls {
		if d.Group == nil && d.Reason == kvcore.ReasonUndecodable {
			return // dead-lettered whole
		}
	}
	var ids struct {
		TaskID string `json:"task_id"`
	}
	if err := json.Unmarshal(rec.Value, &ids); err != nil {
		t.Fatalf("record decoded as no task yet has no undecodable dead letter: %v", err)
	}
	res, ok := fx.outcome(t, ids.TaskID)
	if !ok {
		t.Fatalf("task %q has neither an outcome nor a dead letter", ids.TaskID)
	}
	var offset int64
	if err := fx.pool.QueryRow(context.Background(), `SELECT "offset" FROM save_outcomes WHERE task_id = $1`, ids.TaskID).Scan(&offset); err != nil {
		t.Fatal(err)
	}
	if offset != rec.Offset {
		if len(dls) > 0 {
			t.Fatalf("redelivered task %q left %d dead letters", ids.TaskID, len(dls))
		}
		return // an earlier record of the same task id was accounted
	}
	counted := map[int]bool{}
	for _, g := range res.Groups {
		if g.Stored+g.Existing+g.Skipped+g.DeadLettered+g.Failed == 0 && g.Reason != "" {
			t.Fatalf("group %+v has a reason but no count", g)
		}
		counted[g.Group] = g.DeadLettered > 0 || g.Failed > 0
	}
	for g := range fx.model.Groups {
		if _, ok := counted[g]; !ok {
			t.Fatalf("model group %d missing from the outcome %+v", g, res)
		}
	}
	for _, d := range dls {
		if d.Group == nil || !counted[*d.Group] || d.TaskID != ids.TaskID {
			t.Fatalf("dead letter %+v is not counted in the outcome %+v", d, res)
		}
		if d.Reason == "" || d.Slot == deadletter.WholeRecord {
			t.Fatalf("dead letter %+v lacks a reason or a group slot", d)
		}
	}
}
