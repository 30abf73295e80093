package engines

import (
	"context"
	"fmt"

	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// MaxEngineIDBytes bounds the engine id of a record (as the lookup bounds
// engine_id).
const MaxEngineIDBytes = 256

// Handle is the bus handler of kvmesh.kv.events that feeds the index. It
// keeps only engines' own batches: a record with kvmesh's schema header
// (the sender's events about the store) or without a kvmesh-engine-id
// header is skipped. A batch that does not decode is a permanent failure
// (kvcore.ReasonUndecodable), as are an over-long engine id and an event of
// an unknown group; nothing is ever retried, since applying is in memory.
func (x *Index) Handle(_ context.Context, rec bus.Received) error {
	if rec.Headers[contract.HeaderKVSchema] != "" {
		return nil
	}
	engine := rec.Headers[contract.HeaderKVEngineID]
	switch {
	case engine == "":
		return nil
	case len(engine) > MaxEngineIDBytes:
		return bus.Permanent(kvcore.ReasonBadEngineID, fmt.Errorf("engine id of %d bytes, at most %d: %w", len(engine), MaxEngineIDBytes, contract.ErrKVEventEncoding))
	}
	b, err := contract.DecodeKVEventBatch(rec.Value)
	if err != nil {
		return bus.Permanent(kvcore.ReasonUndecodable, fmt.Errorf("engine %s: %w", engine, err))
	}
	if err := x.Apply(engine, b); err != nil {
		return bus.Permanent(kvcore.ReasonUnknownGroup, err)
	}
	return nil
}
