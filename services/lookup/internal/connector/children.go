package connector

import (
	"context"
	"fmt"

	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
	"github.com/kvmesh/kvmesh/pkg/kvtier"
)

// Store is the store child: MooncakeStoreConnector's lookup. It plans the
// keys of every group and rank namespace, checks them in ONE batched
// existence call, applies the full-hit rule and decides the need.
type Store struct {
	model *kvcore.Model
	keys  kvcore.KeyBuilder
	store kvstore.Store
}

// NewStore returns a store child over store with keys built by kb.
func NewStore(m *kvcore.Model, kb kvcore.KeyBuilder, store kvstore.Store) *Store {
	return &Store{model: m, keys: kb, store: store}
}

// Name implements Connector.
func (s *Store) Name() string { return NameStore }

// Lookup implements Connector. It checks the keys of the query's tenant
// only (kvcore.KeyBuilder.ForTenant), so a tenant never hits another's
// blocks. A prompt shorter than one scheduler block plans no keys and is
// answered 0 without a store call.
//
// A failed existence check fails open, as vLLM's store child does
// (MooncakeStoreWorker.lookup in
// vllm/backends/distributed/kv_transfer/kv_connector/v1/mooncake/store/worker.py,
// commit 055e47c28003156421365af985d676fc921cb075: a raising
// batch_is_exist is recorded and logged and the lookup answers
// MooncakeLookupResult(0); LookupKeyClient.lookup answers 0 likewise when
// the lookup call raises): the child answers 0 tokens with no LoadSpec
// and Answer.Failed set to an error wrapping ErrStore, and returns no
// error, so the chain goes on. Only a query the plan refuses is an error.
func (s *Store) Lookup(ctx context.Context, q *Query) (Answer, error) {
	plan, err := kvcore.PlanLookup(s.model, s.keys.ForTenant(q.Tenant), q.Hashes, q.NumTokens)
	if err != nil {
		return Answer{}, fmt.Errorf("plan: %w", err)
	}
	keys := plan.Keys()
	if len(keys) == 0 {
		return Answer{}, nil
	}
	// vLLM's engine label of lookup_exists is the asking engine. Over a
	// capacity tier, the plan chooses which keys Redis lacks are worth
	// asking the bucket about (kvcore.LookupPlan.Probe).
	ctx = kvtier.WithProber(kvstore.WithVLLMLabels(ctx, kvstore.VLLMLabels{Engine: q.EngineID}), plan)
	exists, err := s.store.Exists(ctx, keys)
	if err != nil {
		return Answer{Failed: fmt.Errorf("%w (%d keys): %w", ErrStore, len(keys), err)}, nil
	}
	hit, err := plan.Resolve(exists)
	if err != nil {
		return Answer{Failed: fmt.Errorf("%w: %w", ErrStore, err)}, nil
	}
	need, spec, async := kvcore.Decide(hit, q.NumComputedTokens, q.LoadAsync)
	if spec != nil && s.model.PartialHashHits() {
		// Each group's last chunk is read from the key the store holds for
		// the hit's block (worker.py MooncakeStoreWorker._tail_key_boundaries,
		// carried to the receiving thread as TailKeyBoundary). Without
		// partial hash hits every tail key is the hit itself, so the spec
		// carries none.
		tails, err := plan.TailKeys(exists, hit)
		if err != nil {
			return Answer{Failed: fmt.Errorf("%w: %w", ErrStore, err)}, nil
		}
		spec.TailKeys = tails
	}
	return Answer{Tokens: need, Spec: spec, Async: async}, nil
}

// PD is the disaggregated-prefill child: it answers from the request's
// kv_transfer_params, without any I/O. The prefill engine computed
// remote_tokens of the prompt; the decode engine loads
//
//	hit = min(remote_tokens, num_tokens − 1), aligned down to the scheduler block size
//
// (the engine must compute at least the last token itself, as vLLM's P/D
// connectors load the whole prefill minus the last token; kvmesh moves
// whole scheduler blocks), and the need and LoadSpec follow kvcore.Decide.
// A request without transfer params is answered 0.
type PD struct {
	model *kvcore.Model
}

// NewPD returns a pd child for model m.
func NewPD(m *kvcore.Model) *PD { return &PD{model: m} }

// Name implements Connector.
func (p *PD) Name() string { return NamePD }

// Lookup implements Connector.
func (p *PD) Lookup(_ context.Context, q *Query) (Answer, error) {
	if q.Transfer == nil {
		return Answer{}, nil
	}
	hit := PDHit(q.Transfer.Tokens, q.NumTokens, p.model.SchedulerBlockSize())
	need, spec, async := kvcore.Decide(hit, q.NumComputedTokens, q.LoadAsync)
	if need == 0 {
		return Answer{}, nil
	}
	return Answer{Tokens: need, Spec: spec, Async: async, PD: q.Transfer}, nil
}

// PDHit is the pd child's hit: min(remoteTokens, numTokens−1) aligned down
// to schedulerBlockSize, and never negative.
func PDHit(remoteTokens, numTokens, schedulerBlockSize int) int {
	hit := min(remoteTokens, numTokens-1)
	if hit <= 0 || schedulerBlockSize <= 0 {
		return 0
	}
	return hit / schedulerBlockSize * schedulerBlockSize
}
