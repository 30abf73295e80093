package load_test

import (
	"encoding/json"
	"errors"
	"slices"
	"testing"

	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/services/gpuworker/internal/load"
)

func TestDecodeTask(t *testing.T) {
	good := `{"schema":"kvmesh.load_task.v1","task_id":"t","engine_id":"e","request_id":"r","model":"m","connector":"store","start":0,"end":16,"block_table":[[1]],"block_hashes":["ab"],"groups":[]}`
	if task, err := load.DecodeTask([]byte(good)); err != nil || task.TaskID != "t" || task.BlockTable[0][0] != 1 {
		t.Fatalf("DecodeTask(good) = %+v, %v", task, err)
	}
	for name, v := range map[string]string{
		"not JSON":         "\x00",
		"unknown field":    `{"schema":"kvmesh.load_task.v1","task_id":"t","engine_id":"e","request_id":"r","extra":1}`,
		"wrong schema":     `{"schema":"kvmesh.save_task.v1","task_id":"t","engine_id":"e","request_id":"r"}`,
		"no task id":       `{"schema":"kvmesh.load_task.v1","engine_id":"e","request_id":"r"}`,
		"no request id":    `{"schema":"kvmesh.load_task.v1","task_id":"t","engine_id":"e"}`,
		"two values":       good + good,
		"block id as text": `{"schema":"kvmesh.load_task.v1","task_id":"t","engine_id":"e","request_id":"r","block_table":[["1"]]}`,
	} {
		t.Run(name, func(t *testing.T) {
			if _, err := load.DecodeTask([]byte(v)); !errors.Is(err, load.ErrInvalidTask) {
				t.Fatalf("error = %v, want ErrInvalidTask", err)
			}
		})
	}
}

func TestListedBlocks(t *testing.T) {
	m, err := kvcore.Preset("hybrid-mla-linear")
	if err != nil {
		t.Fatal(err)
	}
	null := kvcore.NullBlock
	tests := []struct {
		name   string
		table  kvcore.BlockTable
		groups []kvcore.GroupChunks
		want   []kvcore.BlockID
	}{
		{"each chunk's block", kvcore.BlockTable{{1, 2, 3}, {null, null, 4}}, m.LoadGroups(0, 48), []kvcore.BlockID{1, 2, 3, 4}},
		{"only the loaded chunks", kvcore.BlockTable{{1, 2, 3}, {null, null, 4}}, m.LoadGroups(32, 48), []kvcore.BlockID{3, 4}},
		{"a chunk past the table lists the whole group", kvcore.BlockTable{{1, 2}, {null, null, 4}}, m.LoadGroups(0, 48), []kvcore.BlockID{1, 2, 4}},
		{"a group past the model lists its blocks", kvcore.BlockTable{{1}, {2}, {5, null, 6}},
			[]kvcore.GroupChunks{{Group: 2, Chunks: []kvcore.Chunk{{Start: 0, End: 16}}}}, []kvcore.BlockID{5, 6}},
		{"a group past the table lists nothing", kvcore.BlockTable{{1}}, m.LoadGroups(0, 16), []kvcore.BlockID{1}},
		{"duplicates once", kvcore.BlockTable{{7, 7}, {null, 7}}, m.LoadGroups(0, 32), []kvcore.BlockID{7}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			task := &kvcore.LoadTask{BlockTable: tc.table, Groups: tc.groups}
			if got := load.ListedBlocks(m, task); !slices.Equal(got, tc.want) {
				groups, _ := json.Marshal(tc.groups)
				t.Fatalf("ListedBlocks(%v, %s) = %v, want %v", tc.table, groups, got, tc.want)
			}
		})
	}
}
