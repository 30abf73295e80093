package app

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"

	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
	"github.com/kvmesh/kvmesh/services/lookup/internal/api"
	"github.com/kvmesh/kvmesh/services/lookup/internal/engines"
	"github.com/kvmesh/kvmesh/services/lookup/internal/kvpublish"
)

// ScoreStoreOp is the op label of POST /v1/score's existence checks.
const ScoreStoreOp = "score_exists"

// scoreHandler builds POST /v1/score of every served model (scored, the
// default first) over the store (instrumented under ScoreStoreOp) and,
// when idx is not nil, the default model's engines' prefix caches.
func (a *App) scoreHandler(common api.Common, scored []api.ScoreModel, sm *kvstore.Metrics, idx *engines.Index) (*api.ScoreHandler, error) {
	so := api.ScoreOptions{
		Model:  scored[0].Model,
		Keys:   scored[0].Keys,
		More:   scored[1:],
		Store:  kvstore.Instrument(a.deps.Store, sm, kvstore.OpNames{Exists: ScoreStoreOp}),
		Common: common,
	}
	if idx != nil {
		so.Engines = idx // never a nil *Index in the interface
	}
	return api.NewScore(so)
}

// kvEventsConsumer builds the one consumer of kvmesh.kv.events that feeds
// the engines' index (idx) and the ZMQ publisher (pub), each record to
// both; nil when both are nil. Its consumer group is this process's alone
// (every replica must read every record) and starts at the oldest
// retained record, so a restarted lookup rebuilds the index and
// republishes what Kafka retains. Records go one at a time, in order (the
// publisher numbers them). A record either cannot apply is logged and
// skipped.
func (a *App) kvEventsConsumer(cfg Config, idx *engines.Index, pub *kvpublish.Publisher) (*bus.Consumer, error) {
	var handlers []bus.Handler
	if idx != nil {
		handlers = append(handlers, idx.Handle)
	}
	if pub != nil {
		handlers = append(handlers, pub.Handle)
	}
	if len(handlers) == 0 {
		return nil, nil
	}
	var id [8]byte
	_, _ = rand.Read(id[:]) // crypto/rand.Read never fails (it panics instead)
	cc := cfg.ConsumerConfig("kvmesh-lookup-kv-events-"+hex.EncodeToString(id[:]), []string{contract.TopicKVEvents}, a.deps.Log)
	cc.OnDeadLetter = func(ctx context.Context, rec bus.Received, reason kvcore.Reason, cause error) error {
		a.deps.Log.WarnContext(ctx, "kv event record skipped", "reason", reason, "err", cause, "partition", rec.Partition, "offset", rec.Offset)
		return nil
	}
	c, err := bus.NewConsumer(cc, func(ctx context.Context, rec bus.Received) error {
		var errs []error
		for _, h := range handlers {
			errs = append(errs, h(ctx, rec))
		}
		return errors.Join(errs...)
	})
	if err != nil {
		return nil, fmt.Errorf("kv events consumer: %w", err)
	}
	return c, nil
}
