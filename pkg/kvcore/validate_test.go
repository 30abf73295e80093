package kvcore

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"
)

// validTask is a valid save of [32, 64) on model m (two groups of block
// size 16 unless m says otherwise), taken from a tracker.
func validTask(t testing.TB, m *Model) *SaveTask {
	t.Helper()
	tr := NewTracker(m, "e1", "r1")
	tr.OnAdmit(trkHashes(8), 0)
	table := make(BlockTable, len(m.Groups))
	for g := range table {
		table[g] = ids(10*g, 4)
	}
	tr.Step(m, Step{Kind: StepNew, Tokens: 32, Table: table})
	eff := tr.Step(m, Step{Kind: StepRunning, Tokens: 64})
	if len(eff.Saves) != 1 {
		t.Fatalf("no save to validate: %+v", eff)
	}
	return &eff.Saves[0]
}

func TestValidateSaveReasons(t *testing.T) {
	m := trkHybrid(t)
	pool := []int{40, 40}
	type verdicts = map[int]Reason // model group → reason; groups absent are OK
	cases := []struct {
		name   string
		mutate func(s *SaveTask)
		pool   []int
		want   verdicts
		extra  []GroupVerdict // verdicts after the model groups
	}{
		{"valid", func(*SaveTask) {}, pool, verdicts{}, nil},
		{"valid without pool size", func(*SaveTask) {}, nil, verdicts{}, nil},
		{"model_unknown", func(s *SaveTask) { s.Model = "other" }, pool,
			verdicts{0: ReasonModelUnknown, 1: ReasonModelUnknown}, nil},
		{"model_unknown keeps entry verdicts", func(s *SaveTask) {
			s.Model = "other"
			s.Groups = append(s.Groups, GroupChunks{Group: 7})
		}, pool, verdicts{0: ReasonModelUnknown, 1: ReasonModelUnknown}, []GroupVerdict{{Group: 7, Reason: ReasonGroupOutOfRange}}},
		{"valid tenant", func(s *SaveTask) { s.Tenant = "acme-1" }, pool, verdicts{}, nil},
		{"tenant_invalid charset", func(s *SaveTask) { s.Tenant = "acme@1" }, pool,
			verdicts{0: ReasonTenantInvalid, 1: ReasonTenantInvalid}, nil},
		{"tenant_invalid length", func(s *SaveTask) { s.Tenant = strings.Repeat("t", MaxTenantBytes+1) }, pool,
			verdicts{0: ReasonTenantInvalid, 1: ReasonTenantInvalid}, nil},
		{"token_range_invalid unaligned", func(s *SaveTask) { s.Start = 8 }, pool,
			verdicts{0: ReasonTokenRangeInvalid, 1: ReasonTokenRangeInvalid}, nil},
		{"token_range_invalid reversed", func(s *SaveTask) { s.End = s.Start }, pool,
			verdicts{0: ReasonTokenRangeInvalid, 1: ReasonTokenRangeInvalid}, nil},
		{"token_range_invalid negative", func(s *SaveTask) { s.Start = -16 }, pool,
			verdicts{0: ReasonTokenRangeInvalid, 1: ReasonTokenRangeInvalid}, nil},
		{"table_group_count short", func(s *SaveTask) { s.BlockTable = s.BlockTable[:1] }, pool,
			verdicts{1: ReasonTableGroupCount}, nil},
		{"table_group_count empty", func(s *SaveTask) { s.BlockTable = BlockTable{} }, pool,
			verdicts{0: ReasonTableGroupCount, 1: ReasonTableGroupCount}, nil},
		{"table_group_count long", func(s *SaveTask) { s.BlockTable = append(s.BlockTable, ids(0, 4)) }, pool,
			verdicts{0: ReasonTableGroupCount, 1: ReasonTableGroupCount}, nil},
		{"group_out_of_range", func(s *SaveTask) {
			s.Groups = append(s.Groups, GroupChunks{Group: 2}, GroupChunks{Group: -1})
		}, pool, verdicts{}, []GroupVerdict{{Group: 2, Reason: ReasonGroupOutOfRange}, {Group: -1, Reason: ReasonGroupOutOfRange}}},
		{"group_missing", func(s *SaveTask) { s.Groups = s.Groups[:1] }, pool, verdicts{1: ReasonGroupMissing}, nil},
		{"group_duplicate", func(s *SaveTask) { s.Groups = append(s.Groups, s.Groups[0]) }, pool,
			verdicts{}, []GroupVerdict{{Group: 0, Reason: ReasonGroupDuplicate}}},
		{"block_out_of_range pool", func(s *SaveTask) { s.BlockTable[0][3] = 40 }, pool, verdicts{0: ReasonBlockOutOfRange}, nil},
		{"block_out_of_range negative", func(s *SaveTask) { s.BlockTable[1][3] = -7 }, pool, verdicts{1: ReasonBlockOutOfRange}, nil},
		{"null_block", func(s *SaveTask) { s.BlockTable[0][2] = NullBlock }, pool, verdicts{0: ReasonNullBlock}, nil},
		{"null_block outside the chunks is fine", func(s *SaveTask) { s.BlockTable[1][2] = NullBlock }, pool, verdicts{}, nil},
		{"table_too_short", func(s *SaveTask) { s.BlockTable[1] = s.BlockTable[1][:3] }, pool, verdicts{1: ReasonTableTooShort}, nil},
		{"hash_count_mismatch", func(s *SaveTask) { s.BlockHashes = s.BlockHashes[:3] }, pool,
			verdicts{0: ReasonHashCountMismatch, 1: ReasonHashCountMismatch}, nil},
		{"token ids of whole hash blocks", func(s *SaveTask) { s.TokenIDs = make([]uint32, 32) }, pool, verdicts{}, nil},
		{"token ids of every hash", func(s *SaveTask) { s.TokenIDs = make([]uint32, 16*len(s.BlockHashes)) }, pool, verdicts{}, nil},
		{"token_ids_invalid partial block", func(s *SaveTask) { s.TokenIDs = make([]uint32, 20) }, pool,
			verdicts{0: ReasonTokenIDsInvalid, 1: ReasonTokenIDsInvalid}, nil},
		{"token_ids_invalid past the hashes", func(s *SaveTask) { s.TokenIDs = make([]uint32, 16*(len(s.BlockHashes)+1)) }, pool,
			verdicts{0: ReasonTokenIDsInvalid, 1: ReasonTokenIDsInvalid}, nil},
		{"hash_invalid only where used", func(s *SaveTask) { s.BlockHashes[2] = "NOT-HEX" }, pool, verdicts{0: ReasonHashInvalid}, nil},
		{"chunks_mismatch", func(s *SaveTask) { s.Groups[1].Chunks = []Chunk{{Start: 32, End: 48}} }, pool,
			verdicts{1: ReasonChunksMismatch}, nil},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			task := validTask(t, m)
			c.mutate(task)
			vs := ValidateSave(m, c.pool, task)
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
	vs := ValidateSave(nil, nil, task)
	if len(vs) != 2 || vs[0].Reason != ReasonModelUnknown || vs[1].Reason != ReasonModelUnknown {
		t.Fatalf("verdicts %+v", vs)
	}
	vs = ValidateSave(trkHybrid(t), nil, nil)
	if len(vs) != 2 || vs[0].Reason != ReasonModelUnknown || vs[1].Reason != ReasonModelUnknown {
		t.Fatalf("nil task verdicts %+v", vs)
	}
}

func TestValidateSavePresets(t *testing.T) {
	for _, name := range PresetNames() {
		t.Run(name, func(t *testing.T) {
			m, err := Preset(name)
			if err != nil {
				t.Fatal(err)
			}
			for _, v := range ValidateSave(m, nil, validTask(t, m)) {
				if !v.OK() {
					t.Fatalf("tracker-built save rejected: %+v", v)
				}
			}
		})
	}
}

func TestDecodeSaveTask(t *testing.T) {
	m := trkHybrid(t)
	good, err := json.Marshal(validTask(t, m))
	if err != nil {
		t.Fatal(err)
	}
	task, err := DecodeSaveTask(good)
	if err != nil {
		t.Fatalf("valid task: %v", err)
	}
	if vs := ValidateSave(m, nil, task); !vs[0].OK() || !vs[1].OK() {
		t.Fatalf("decoded task invalid: %+v", vs)
	}
	withNull := strings.Replace(string(good), `"block_table":[[0,`, `"block_table":[[null,`, 1)
	if task, err := DecodeSaveTask([]byte(withNull)); err != nil || task.BlockTable[0][0] != NullBlock {
		t.Fatalf("null block: %v %v", err, task)
	}
	bad := map[string]string{
		"unknown field":   strings.Replace(string(good), `"start"`, `"bogus":1,"start"`, 1),
		"wrong schema":    strings.Replace(string(good), SchemaSaveTask, "kvmesh.save_task.v0", 1),
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
			if _, err := DecodeSaveTask([]byte(in)); !errors.Is(err, ErrInvalidSaveTask) {
				t.Fatalf("error %v, want ErrInvalidSaveTask", err)
			}
		})
	}
}
