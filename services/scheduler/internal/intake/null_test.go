package intake

import (
	"errors"
	"fmt"
	"reflect"
	"testing"

	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/services/scheduler/requeststate"
)

// TestDecodeStepNormalisesTheEnginesNullBlock: a step record's tables are
// normalised at intake with the record's null_block_id, so the tracker and
// the tasks it emits only know kvcore.NullBlock. Under null id 0 (vLLM's)
// the entry 0 is null; without a declaration it is block 0.
func TestDecodeStepNormalisesTheEnginesNullBlock(t *testing.T) {
	m := &kvcore.Model{Name: "m", HashBlockSize: 16, Groups: []kvcore.Group{{Kind: kvcore.KindFullAttention, BlockSize: 16, BytesPerBlock: 64}}}
	hashes := []string{fmt.Sprintf("%064x", 1), fmt.Sprintf("%064x", 2)}
	record := func(nullID string) []byte {
		return fmt.Appendf(nil, `{"schema":%q,"step_id":"e/1","engine_id":"e","model":"m","step":1%s,"requests":[
			{"request_id":"r","seq":1,"kind":"admitted","prompt_tokens":40,"block_hashes":[%q,%q]},
			{"request_id":"r","seq":2,"kind":"allocated","block_table":[[0,1,null]]},
			{"request_id":"r","seq":3,"kind":"scheduled","step":{"kind":"new","tokens":32,"block_table":[[0,1,null]]}}]}`,
			contract.SchemaEngineStep, nullID, hashes[0], hashes[1])
	}
	cases := []struct {
		name   string
		nullID string
		want   kvcore.BlockTable
	}{
		{"null id 0", `,"null_block_id":0`, kvcore.BlockTable{{kvcore.NullBlock, 1, kvcore.NullBlock}}},
		{"JSON null declaration", `,"null_block_id":null`, kvcore.BlockTable{{0, 1, kvcore.NullBlock}}},
		{"no declaration", ``, kvcore.BlockTable{{0, 1, kvcore.NullBlock}}},
		{"null id 7", `,"null_block_id":7`, kvcore.BlockTable{{0, 1, kvcore.NullBlock}}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			it, err := decode(bus.Received{Message: bus.Message{Topic: contract.TopicEngineSteps, Value: record(tc.nullID)}}, testRules)
			if err != nil || len(it.changes) != 3 {
				t.Fatalf("decode: %d changes, %v", len(it.changes), err)
			}
			req := requeststate.New(m, "e", "r")
			var saves []kvcore.SaveTask
			for _, ch := range it.changes {
				out := req.Apply(m, ch.event)
				saves = append(saves, out.Saves...)
			}
			if len(saves) != 1 {
				t.Fatalf("saves %+v, want one", saves)
			}
			if !reflect.DeepEqual(saves[0].BlockTable, tc.want) {
				t.Fatalf("save's table %v, want %v", saves[0].BlockTable, tc.want)
			}
			if !reflect.DeepEqual(req.Store.Table, tc.want) {
				t.Fatalf("tracker's table %v, want %v", req.Store.Table, tc.want)
			}
		})
	}
}

func TestDecodeStepRefusesANegativeNullBlockID(t *testing.T) {
	v := fmt.Appendf(nil, `{"schema":%q,"step_id":"e/1","engine_id":"e","model":"m","null_block_id":-1,"requests":[]}`, contract.SchemaEngineStep)
	_, err := decode(bus.Received{Message: bus.Message{Topic: contract.TopicEngineSteps, Value: v}}, testRules)
	var pe *bus.PermanentError
	if !errors.As(err, &pe) || pe.Reason != kvcore.ReasonInvalidRecord {
		t.Fatalf("error %v, want permanent %s", err, kvcore.ReasonInvalidRecord)
	}
}
