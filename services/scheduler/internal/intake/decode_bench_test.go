package intake

import (
	"encoding/hex"
	"encoding/json"
	"fmt"
	"testing"

	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// benchStep is a step record shaped like BenchmarkScheduler's 2K engines':
// decodes of one block each, and a few requests admitted (128 hashes),
// allocated and scheduled new (128 blocks).
func benchStep(b *testing.B) []byte {
	b.Helper()
	st := contract.EngineStep{Schema: contract.SchemaEngineStep, StepID: "e/1", EngineID: "e", Model: "m", Step: 1}
	for i := range 30 {
		st.Requests = append(st.Requests, contract.RequestEvent{RequestID: fmt.Sprint("d", i), Seq: 9, Kind: contract.EventScheduled,
			Step: &kvcore.Step{Kind: kvcore.StepDecode, Tokens: 2100, Table: kvcore.BlockTable{{kvcore.BlockID(5000 + i)}}}})
	}
	for i := range 4 {
		id := fmt.Sprint("n", i)
		hashes := make([]string, 128)
		table := kvcore.BlockTable{make([]kvcore.BlockID, 128)}
		for j := range hashes {
			hashes[j] = hex.EncodeToString(fmt.Appendf(nil, "%032d", i*1000+j))
			table[0][j] = kvcore.BlockID(i*128 + j)
		}
		st.Requests = append(st.Requests,
			contract.RequestEvent{RequestID: id, Seq: 1, Kind: contract.EventAdmitted, PromptTokens: 2048, BlockHashes: hashes},
			contract.RequestEvent{RequestID: id, Seq: 2, Kind: contract.EventAllocated, BlockTable: table},
			contract.RequestEvent{RequestID: id, Seq: 3, Kind: contract.EventScheduled, Step: &kvcore.Step{Kind: kvcore.StepNew, Tokens: 2048, Table: table}})
	}
	v, err := json.Marshal(st)
	if err != nil {
		b.Fatal(err)
	}
	return v
}

func BenchmarkDecodeStep(b *testing.B) {
	rec := bus.Received{Message: bus.Message{Topic: contract.TopicEngineSteps, Value: benchStep(b)}}
	b.SetBytes(int64(len(rec.Value)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := decode(rec, testRules); err != nil {
			b.Fatal(err)
		}
	}
}
