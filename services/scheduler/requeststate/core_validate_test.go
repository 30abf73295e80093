package requeststate

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// validTask is a valid save of [32, 64) on model m (two groups of block
// size 16 unless m says otherwise), taken from a tracker.
func validTask(t testing.TB, m *kvcore.Model) *kvcore.SaveTask {
	t.Helper()
	tr := NewTracker(m, "e1", "r1")
	tr.OnAdmit(trkHashes(8), 0)
	table := make(kvcore.BlockTable, len(m.Groups))
	for g := range table {
		table[g] = ids(10*g, 4)
	}
	tr.Step(m, kvcore.Step{Kind: kvcore.StepNew, Tokens: 32, Table: table})
	eff := tr.Step(m, kvcore.Step{Kind: kvcore.StepRunning, Tokens: 64})
	if len(eff.Saves) != 1 {
		t.Fatalf("no save to validate: %+v", eff)
	}
	return &eff.Saves[0]
}

func TestValidateSaveReasons(t *testing.T) {
	m := trkHybrid(t)
	pool := []int{40, 40}
	type verdicts = map[int]kvcore.Reason // model group → reason; groups absent are OK
	cases := []struct {
		name   string
		mutate func(s *kvcore.SaveTask)
		pool   []int
		want   verdicts
		extra  []kvcore.GroupVerdict // verdicts after the model groups
	}{
		{"valid", func(*kvcore.SaveTask) {}, pool, verdicts{}, nil},
		{"valid without pool size", func(*kvcore.SaveTask) {}, nil, verdicts{}, nil},
		{"model_unknown", func(s *kvcore.SaveTask) { s.Model = "other" }, pool,
			verdicts{0: kvcore.ReasonModelUnknown, 1: kvcore.ReasonModelUnknown}, nil},
		{"model_unknown keeps entry verdicts", func(s *kvcore.SaveTask) {
			s.Model = "other"
			s.Groups = append(s.Groups, kvcore.GroupChunks{Group: 7})
		}, pool, verdicts{0: kvcore.ReasonModelUnknown, 1: kvcore.ReasonModelUnknown}, []kvcore.GroupVerdict{{Group: 7, Reason: kvcore.ReasonGroupOutOfRange}}},
		{"valid tenant", func(s *kvcore.SaveTask) { s.Tenant = "acme-1" }, pool, verdicts{}, nil},
		{"tenant_invalid charset", func(s *kvcore.SaveTask) { s.Tenant = "acme@1" }, pool,
			verdicts{0: kvcore.ReasonTenantInvalid, 1: kvcore.ReasonTenantInvalid}, nil},
		{"tenant_invalid length", func(s *kvcore.SaveTask) { s.Tenant = strings.Repeat("t", kvcore.MaxTenantBytes+1) }, pool,
			verdicts{0: kvcore.ReasonTenantInvalid, 1: kvcore.ReasonTenantInvalid}, nil},
		{"token_range_invalid unaligned", func(s *kvcore.SaveTask) { s.Start = 8 }, pool,
			verdicts{0: kvcore.ReasonTokenRangeInvalid, 1: kvcore.ReasonTokenRangeInvalid}, nil},
		{"token_range_invalid reversed", func(s *kvcore.SaveTask) { s.End = s.Start }, pool,
			verdicts{0: kvcore.ReasonTokenRangeInvalid, 1: kvcore.ReasonTokenRangeInvalid}, nil},
		{"token_range_invalid negative", func(s *kvcore.SaveTask) { s.Start = -16 }, pool,
			verdicts{0: kvcore.ReasonTokenRangeInvalid, 1: kvcore.ReasonTokenRangeInvalid}, nil},
		{"table_group_count short", func(s *kvcore.SaveTask) { s.BlockTable = s.BlockTable[:1] }, pool,
			verdicts{1: kvcore.ReasonTableGroupCount}, nil},
		{"table_group_count empty", func(s *kvcore.SaveTask) { s.BlockTable = kvcore.BlockTable{} }, pool,
			verdicts{0: kvcore.ReasonTableGroupCount, 1: kvcore.ReasonTableGroupCount}, nil},
		{"table_group_count long", func(s *kvcore.SaveTask) { s.BlockTable = append(s.BlockTable, ids(0, 4)) }, pool,
			verdicts{0: kvcore.ReasonTableGroupCount, 1: kvcore.ReasonTableGroupCount}, nil},
		{"group_out_of_range", func(s *kvcore.SaveTask) {
			s.Groups = append(s.Groups, kvcore.GroupChunks{Group: 2}, kvcore.GroupChunks{Group: -1})
		}, pool, verdicts{}, []kvcore.GroupVerdict{{Group: 2, Reason: kvcore.ReasonGroupOutOfRange}, {Group: -1, Reason: kvcore.ReasonGroupOutOfRange}}},
		{"group_missing", func(s *kvcore.SaveTask) { s.Groups = s.Groups[:1] }, pool, verdicts{1: kvcore.ReasonGroupMissing}, nil},
		{"group_duplicate", func(s *kvcore.SaveTask) { s.Groups = append(s.Groups, s.Groups[0]) }, pool,
			verdicts{}, []kvcore.GroupVerdict{{Group: 0, Reason: kvcore.ReasonGroupDuplicate}}},
		{"block_out_of_range pool", func(s *kvcore.SaveTask) { s.BlockTable[0][3] = 40 }, pool, verdicts{0: kvcore.ReasonBlockOutOfRange}, nil},
		{"block_out_of_range negative", func(s *kvcore.SaveTask) { s.BlockTable[1][3] = -7 }, pool, verdicts{1: kvcore.ReasonBlockOutOfRange}, nil},
		{"null_block", func(s *kvcore.SaveTask) { s.BlockTable[0][2] = kvcore.NullBlock }, pool, verdicts{0: kvcore.ReasonNullBlock}, nil},
		{"null_block outside the chunks is fine", func(s *kvcore.SaveTask) { s.BlockTable[1][2] = kvcore.NullBlock }, pool, verdicts{}, nil},
		{"table_too_short", func(s *kvcore.SaveTask) { s.BlockTable[1] = s.BlockTable[1][:3] }, pool, verdicts{1: kvcore.ReasonTableTooShort}, nil},
		{"hash_count_mismatch", func(s *kvcore.SaveTask) { s.BlockHashes = s.BlockHashes[:3] }, pool,
			verdicts{0: kvcore.ReasonHashCountMismatch, 1: kvcore.ReasonHashCountMismatch}, nil},
		{"token ids of whole hash blocks", func(s *kvcore.SaveTask) { s.TokenIDs = make([]uint32, 32) }, pool, verdicts{}, nil},
		{"token ids of every hash", func(s *kvcore.SaveTask) { s.TokenIDs = make([]uint32, 16*len(s.BlockHashes)) }, pool, verdicts{}, nil},
		{"token_ids_invalid partial block", func(s *kvcore.SaveTask) { s.TokenIDs = make([]uint32, 20) }, pool,
			verdicts{0: kvcore.ReasonTokenIDsInvalid, 1: kvcore.ReasonTokenIDsInvalid}, nil},
		{"token_ids_invalid past the hashes", func(s *kvcore.SaveTask) { s.TokenIDs = make([]uint32, 16*(len(s.BlockHashes)+1)) }, pool,
			verdicts{0: kvcore.ReasonTokenIDsInvalid, 1: kvcore.ReasonTokenIDsInvalid}, nil},
		{"hash_invalid only where used", func(s *kvcore.SaveTask) { s.BlockHashes[2] = "NOT-HEX" }, pool, verdicts{0: kvcore.ReasonHashInvalid}, nil},
		{"chunks_mismatch", func(s *kvcore.SaveTask) { s.Groups[1].Chunks = []kvcore.Chunk{{Start: 32, End: 48}} }, pool,
			verdicts{1: kvcore.ReasonChunksMismatch}, nil},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			task := validTask(t, m)
			c.mutate(task)
			vs := kvcore.ValidateSave(m, c.pool, task)
			if len(vs) != len(m.Groups)+len(c.extra) {
				t.Fatalf("%d verdicts, want %d: %+v", len(vs), len(m.Groups)+len(c.extra), vs)
			}
			for g := range m.Groups {
				if vs[g].Group != g || vs[g].Reason != c.want[g] {
					t.Fatalf("group %d verdict %+v, want reason %q", g, vs[g], c.want[g])
				}
				if !vs[g].OK() && vs[g].Detail == "" {
					t.Fatalf("group %d: reason without detail", g)
				}
			}
			for i, e := range c.extra {
				got := vs[len(m.Groups)+i]
				if got.Group != e.Group || got.Reason != e.Reason || got.Detail == "" {
					t.Fatalf("extra verdict %d: %+v, want %+v", i, got, e)
				}
			}
		})
	}
}

func TestValidateSaveNilModel(t *testing.T) {
	task := validTask(t, trkHybrid(t))
	vs := kvcore.ValidateSave(nil, nil, task)
	if len(vs) != 2 || vs[0].Reason != kvcore.ReasonModelUnknown || vs[1].Reason != kvcore.ReasonModelUnknown {
		t.Fatalf("verdicts %+v", vs)
	}
	vs = kvcore.ValidateSave(trkHybrid(t), nil, nil)
	if len(vs) != 2 || vs[0].Reason != kvcore.ReasonModelUnknown || vs[1].Reason != kvcore.ReasonModelUnknown {
		t.Fatalf("nil task verdicts %+v", vs)
	}
}

func TestDecodeSaveTask(t *testing.T) {
	m := trkHybrid(t)
	good, err := json.Marshal(validTask(t, m))
	if err != nil {
		t.Fatal(err)
	}
	task, err := kvcore.DecodeSaveTask(good)
	if err != nil {
		t.Fatalf("valid task: %v", err)
	}
	if vs := kvcore.ValidateSave(m, nil, task); !vs[0].OK() || !vs[1].OK() {
		t.Fatalf("decoded task invalid: %+v", vs)
	}
	withNull := strings.Replace(string(good), `"block_table":[[0,`, `"block_table":[[null,`, 1)
	if task, err := kvcore.DecodeSaveTask([]byte(withNull)); err != nil || task.BlockTable[0][0] != kvcore.NullBlock {
		t.Fatalf("null block: %v %v", err, task)
	}
	bad := map[string]string{
		"unknown field":   strings.Replace(string(good), `"start"`, `"bogus":1,"start"`, 1),
		"wrong schema":    strings.Replace(string(good), kvcore.SchemaSaveTask, "kvmesh.save_task.v0", 1),
		"missing task id": strings.Replace(string(good), `"task_id":"e1/r1/save/2"`, `"task_id":""`, 1),
		"trailing data":   string(good) + `{}`,
		"not an object":   `[1,2]`,
		"empty":           ``,
		"bad block id":    strings.Replace(string(good), `"block_table":[[0,`, `"block_table":[[0.5,`, 1),
	}
	for name, in := range bad {
		t.Run(name, func(t *testing.T) {
			if in == string(good) {
				t.Fatal("mutation did not apply")
			}
			if _, err := kvcore.DecodeSaveTask([]byte(in)); !errors.Is(err, kvcore.ErrInvalidSaveTask) {
				t.Fatalf("error %v, want ErrInvalidSaveTask", err)
			}
		})
	}
}

func TestValidateSavePresets(t *testing.T) {
	for _, name := range kvcore.PresetNames() {
		t.Run(name, func(t *testing.T) {
			m, err := kvcore.Preset(name)
			if err != nil {
				t.Fatal(err)
			}
			for _, v := range kvcore.ValidateSave(m, nil, validTask(t, m)) {
				if !v.OK() {
					t.Fatalf("tracker-built save rejected: %+v", v)
				}
			}
		})
	}
}
