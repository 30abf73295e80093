package engines

import (
	"context"
	"fmt"

	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
)

// MaxEngineIDBytes bounds the engine id of a record (as the lookup bounds
// engine_id).
const MaxEngineIDBytes = 256

// Dead-letter reasons of Handle, besides bus.ReasonUndecodable.
const (
	// ReasonBadEngineID: the kvmesh-engine-id header is over
	// MaxEngineIDBytes.
	ReasonBadEngineID = "bad_engine_id"
	// ReasonUnknownGroup: an event names a group the model does not have
	// (the rest of its batch was applied).
	ReasonUnknownGroup = "unknown_group"
)

// Handle is the bus handler of kvmesh.kv.events that feeds the index. It
// keeps only engines' own batches: a record with kvmesh's schema header
// (the sender's events about the store) or without a kvmesh-engine-id
// header is skipped. A batch that does not decode is a permanent failure
// (bus.ReasonUndecodable), as are an over-long engine id and an event of
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
		return bus.Permanent(ReasonBadEngineID, fmt.Errorf("engine id of %d bytes, at most %d: %w", len(engine), MaxEngineIDBytes, contract.ErrKVEventEncoding))
	}
	b, err := contract.DecodeKVEventBatch(rec.Value)
	if err != nil {
		return bus.Permanent(bus.ReasonUndecodable, fmt.Errorf("engine %s: %w", engine, err))
	}
	if err := x.Apply(engine, b); err != nil {
		return bus.Permanent(ReasonUnknownGroup, err)
	}
	return nil
}
