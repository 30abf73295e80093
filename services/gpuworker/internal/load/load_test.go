package load_test

import (
	"errors"
	"testing"

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
