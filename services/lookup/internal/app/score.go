package app

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"

	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
	"github.com/kvmesh/kvmesh/services/lookup/internal/api"
	"github.com/kvmesh/kvmesh/services/lookup/internal/engines"
)

// ScoreStoreOp is the op label of POST /v1/score's existence checks.
const ScoreStoreOp = "score_exists"

// scoreHandler builds POST /v1/score over the store (instrumented under
// ScoreStoreOp) and, when idx is not nil, the engines' prefix caches.
func (a *App) scoreHandler(cfg Config, kb kvcore.KeyBuilder, sm *kvstore.Metrics, idx *engines.Index) (*api.ScoreHandler, error) {
	so := api.ScoreOptions{
		Model:        a.model,
		Keys:         kb,
		Store:        kvstore.Instrument(a.deps.Store, sm, kvstore.OpNames{Exists: ScoreStoreOp}),
		Timeout:      cfg.Timeout,
		MaxBodyBytes: cfg.MaxBodyBytes,
		Registry:     a.deps.Registry,
		Log:          a.deps.Log,
	}
	if idx != nil {
		so.Engines = idx // never a nil *Index in the interface
	}
	return api.NewScore(so)
}

// engineIndex builds the index of the engines' own prefix caches and the
// consumer that feeds it from kvmesh.kv.events, in a consumer group of
// this process alone (every replica must read every engine's events) that
// starts at the oldest retained record, so a restarted lookup rebuilds the
// index. A record it cannot apply is logged and skipped.
func (a *App) engineIndex(cfg Config) (*engines.Index, error) {
	idx := engines.NewIndex(len(a.model.Groups))
	var id [8]byte
	_, _ = rand.Read(id[:]) // crypto/rand.Read never fails (it panics instead)
	cc := cfg.ConsumerConfig("kvmesh-lookup-engines-"+hex.EncodeToString(id[:]), []string{contract.TopicKVEvents}, a.deps.Log)
	cc.OnDeadLetter = func(ctx context.Context, rec bus.Received, reason string, cause error) error {
		a.deps.Log.WarnContext(ctx, "engine kv event record skipped", "reason", reason, "err", cause, "partition", rec.Partition, "offset", rec.Offset)
		return nil
	}
	c, err := bus.NewConsumer(cc, idx.Handle)
	if err != nil {
		return nil, fmt.Errorf("engine kv events consumer: %w", err)
	}
	a.engines = c
	return idx, nil
}
