package sending

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
	"github.com/kvmesh/kvmesh/pkg/registry"
	"github.com/kvmesh/kvmesh/pkg/retry"
	"github.com/kvmesh/kvmesh/services/sender/internal/sendpolicy"
)

// exists asks the store which keys of task's items are present, in one
// batched call, retried per the retry policy (retry.Attempts with its
// Delays until ExistsFailed gives up or ctx ends); it returns the last
// call's error.
func (p *Processor) exists(ctx context.Context, task *kvcore.SaveTask, items []item) ([]bool, error) {
	ctx, span := p.startCall(ctx, "sender.exists", task, items)
	defer span.End()
	ctx = kvstore.WithVLLMLabels(ctx, kvstore.VLLMLabels{Engine: task.EngineID}) // vLLM's engine label of save_exists
	keys := itemKeys(items)
	found, err := retry.Attempts(ctx, p.retry.Delays(), func(attempt int) ([]bool, error) {
		found, err := p.existsOnce(ctx, keys)
		if err == nil {
			return found, nil
		}
		span.RecordError(err)
		if ctx.Err() != nil || p.retry.ExistsFailed(attempt).Action != sendpolicy.RetryAgain {
			return nil, retry.Permanent(err)
		}
		return nil, err
	})
	if err != nil {
		span.SetStatus(codes.Error, string(kvcore.ReasonExistsFailed))
		span.SetAttributes(attribute.String("kvmesh.reason", string(kvcore.ReasonExistsFailed)))
		return nil, err
	}
	return found, nil
}

// existsOnce is one existence check of keys, bounded by the store timeout
// (a dry run makes only this one).
func (p *Processor) existsOnce(ctx context.Context, keys []string) ([]bool, error) {
	ctx, cancel := context.WithTimeout(ctx, p.storeTimeout)
	defer cancel()
	found, err := p.store.Exists(ctx, keys)
	if err == nil && len(found) != len(keys) {
		err = fmt.Errorf("store answered %d of %d keys", len(found), len(keys))
	}
	return found, err
}

// itemKeys lists the keys of items, in order.
func itemKeys(items []item) []string {
	keys := make([]string, len(items))
	for i, it := range items {
		keys[i] = it.Key
	}
	return keys
}

// rankAnswer is what one rank's worker answered to its batch.
type rankAnswer struct {
	results []dataplane.PutResult
	bytes   int64
	err     error
}

// putRanks puts every batch of task through its rank's worker, one
// goroutine per rank, and returns the answers in the order of batches.
func (p *Processor) putRanks(ctx context.Context, task *kvcore.SaveTask, batches [][]item) []rankAnswer {
	out := make([]rankAnswer, len(batches))
	if len(batches) == 1 {
		out[0] = p.putRank(ctx, task, batches[0])
		return out
	}
	var wg sync.WaitGroup
	for i, batch := range batches {
		wg.Go(func() { out[i] = p.putRank(ctx, task, batch) })
	}
	wg.Wait()
	return out
}

// putRank puts one rank's batch, retrying a missing or unreachable worker
// per the retry policy (retry.Attempts with its Delays until PutFailed
// gives up or ctx ends). A rejected request is not retried.
func (p *Processor) putRank(ctx context.Context, task *kvcore.SaveTask, batch []item) rankAnswer {
	rank := batch[0].rank
	ctx, span := p.startCall(ctx, "sender.put", task, batch, attribute.String("kvmesh.rank", fmt.Sprintf("%+v", rank)))
	defer span.End()
	req := make([]dataplane.PutItem, len(batch))
	for i, it := range batch {
		req[i] = dataplane.PutItem{BlockRef: dataplane.BlockRef{Group: it.Group, Block: it.Block}, Key: it.Key,
			Hash: it.Hash, RequestID: task.RequestID}
	}
	answer, err := retry.Attempts(ctx, p.retry.Delays(), func(attempt int) (rankAnswer, error) {
		results, n, err := p.putOnce(ctx, task.EngineID, rank, req)
		if err == nil {
			return rankAnswer{results: results, bytes: n}, nil
		}
		span.RecordError(err)
		p.workers.Forget(task.EngineID)
		if errors.Is(err, dataplane.ErrRejected) || ctx.Err() != nil || p.retry.PutFailed(attempt).Action != sendpolicy.RetryAgain {
			return rankAnswer{}, retry.Permanent(err)
		}
		return rankAnswer{}, err
	})
	if err != nil {
		span.SetStatus(codes.Error, string(kvcore.ReasonPutFailed))
		span.SetAttributes(attribute.String("kvmesh.reason", string(kvcore.ReasonPutFailed)))
		return rankAnswer{err: err}
	}
	return answer
}

func (p *Processor) putOnce(ctx context.Context, engineID string, rank kvcore.Rank, req []dataplane.PutItem) ([]dataplane.PutResult, int64, error) {
	ctx, cancel := context.WithTimeout(ctx, p.putTimeout) // the registry look-up too: a stuck one is retried
	defer cancel()
	putters, err := p.workers.Engine(ctx, engineID)
	if err != nil {
		return nil, 0, err
	}
	putter, ok := putters[rank]
	if !ok {
		return nil, 0, fmt.Errorf("engine %q rank %s: %w", engineID, rank, registry.ErrNoWorker)
	}
	results, n, err := putter.Put(ctx, req)
	if err == nil && len(results) != len(req) {
		err = fmt.Errorf("worker answered %d of %d items: %w", len(results), len(req), dataplane.ErrFrame)
	}
	return results, n, err
}

// startCall starts the span of one store or worker call for items of
// task: the task's ids, the number of keys, their groups in order, and
// extra.
func (p *Processor) startCall(ctx context.Context, name string, task *kvcore.SaveTask, items []item, extra ...attribute.KeyValue) (context.Context, trace.Span) {
	var gs []int
	for _, g := range itemGroups(items) {
		gs = append(gs, g.group)
	}
	attrs := append(taskAttrs(task), attribute.Int("keys", len(items)), attribute.IntSlice("kvmesh.groups", gs))
	return p.tracer.Start(ctx, name, trace.WithAttributes(append(attrs, extra...)...))
}
