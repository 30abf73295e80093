package app_test

import (
	"context"
	"reflect"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/internal/servicetest"
	"github.com/kvmesh/kvmesh/pkg/adminapi"
	"github.com/kvmesh/kvmesh/pkg/auth"
	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// engineEvents publishes one engine's own vLLM KV event batch to
// kvmesh.kv.events, as an engine bridging its events to kvmesh does: the
// batch as the value, the engine in kvmesh-engine-id, no schema header
// (extra adds headers). Every record has one key, so the test's records
// are consumed in the order published.
func engineEvents(t *testing.T, p *bus.Producer, engine string, extra map[string]string, events ...contract.KVEvent) {
	t.Helper()
	value, err := contract.EncodeKVEventBatch(contract.KVEventBatch{TS: 1, Events: events}, contract.KVEventFormMap)
	if err != nil {
		t.Fatal(err)
	}
	headers := map[string]string{contract.HeaderKVEngineID: engine}
	for k, v := range extra {
		headers[k] = v
	}
	if err := p.Publish(context.Background(), bus.Message{Topic: contract.TopicKVEvents, Key: "score-test", Value: value, Headers: headers}); err != nil {
		t.Fatal(err)
	}
}

// blocks is a BlockStored (or, removed, BlockRemoved) event of group g
// for the hashes at indices idx.
func blocks(kind contract.KVEventKind, g int, hashes []kvcore.BlockHash, idx ...int) contract.KVEvent {
	e := contract.KVEvent{Kind: kind, GroupIdx: &g}
	for _, i := range idx {
		e.BlockHashes = append(e.BlockHashes, contract.WireHash(hashes[i]))
	}
	return e
}

// TestScoreEngines: with KVMESH_LOOKUP_ENGINE_SCORES the score also says,
// per engine, what the engine's own prefix cache holds of the prompt, from
// the KV events engines publish, under the store's rules: engine-a holds
// every full-attention block and the sliding window before 48, so it hits
// 48; engine-b holds full attention to 32 but its window only to 16, so it
// hits 16 while a folding router counts 32. kvmesh's own store events are
// not an engine's; a removal is applied; a tenant-scoped credential gets
// no engine scores (engines' events name no tenant).
func TestScoreEngines(t *testing.T) {
	env := servicetest.NewEnv(t)
	s := startLookup(t, env, map[string]string{
		"KVMESH_MODEL": writeSpec(t, specFullSWA32), "KVMESH_LOOKUP_ENGINE_SCORES": "true",
		"KVMESH_AUTH": auth.ModeRequired, "KVMESH_AUTH_KEY": servicetest.AuthKey, "KVMESH_ADMIN_TOKEN": "test-token",
	})
	p, err := bus.NewProducer(env.Brokers)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	toks := tokens(64, 2704)
	hashes := kvcore.HashChain(toks, 16, nil)
	engineEvents(t, p, "engine-c", map[string]string{contract.HeaderKVSchema: contract.SchemaKVEvent, contract.HeaderKVNamespace: "ns"},
		contract.KVEvent{Kind: contract.BlockStored, BlockHashes: []uint64{contract.WireHash(hashes[0])}})
	engineEvents(t, p, "engine-a", nil, blocks(contract.BlockStored, 0, hashes, 0, 1, 2, 3), blocks(contract.BlockStored, 1, hashes, 1, 2))
	engineEvents(t, p, "engine-b", nil, blocks(contract.BlockStored, 0, hashes, 0, 1), blocks(contract.BlockStored, 1, hashes, 0))
	operator := map[string]string{"Authorization": "Bearer test-token"}

	want := map[string]adminapi.TierScore{
		"engine-a": {HitTokens: 48, AnyGroupPrefixTokens: 64, Groups: []adminapi.GroupScore{
			{Group: 0, Kind: "full_attention", BlockSize: 16, PrefixTokens: 64, UsableTokens: 64},
			{Group: 1, Kind: "sliding_window", BlockSize: 16, PrefixTokens: 0, UsableTokens: 48}}},
		"engine-b": {HitTokens: 16, AnyGroupPrefixTokens: 32, Groups: []adminapi.GroupScore{
			{Group: 0, Kind: "full_attention", BlockSize: 16, PrefixTokens: 32, UsableTokens: 32},
			{Group: 1, Kind: "sliding_window", BlockSize: 16, PrefixTokens: 16, UsableTokens: 16}}},
	}
	var got adminapi.ScoreResponse
	eventually(t, "both engines' events applied", func() bool {
		got = s.score(t, scoreBody(toks, ""), operator)
		return len(got.Engines) == 2 && got.Engines["engine-a"].HitTokens == 48 && got.Engines["engine-b"].HitTokens == 16
	})
	if !reflect.DeepEqual(got.Engines, want) || got.Store.HitTokens != 0 {
		t.Fatalf("score %s, want engines %s and nothing in the store", asJSON(got), asJSON(want))
	}

	// An engine token bound to a tenant scores the store only.
	key, err := auth.NewKey(servicetest.AuthKey)
	if err != nil {
		t.Fatal(err)
	}
	tok, err := key.Mint(auth.KindEngine, "engine-a", []string{"acme"}, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	if res := s.score(t, scoreBody(toks, "acme"), map[string]string{"Authorization": "Bearer " + tok}); res.Engines != nil {
		t.Errorf("a tenant-scoped credential got engine scores %s", asJSON(res.Engines))
	}

	// engine-a evicts its first full-attention block: it hits nothing.
	engineEvents(t, p, "engine-a", nil, blocks(contract.BlockRemoved, 0, hashes, 0))
	eventually(t, "engine-a's removal applied", func() bool {
		e := s.score(t, scoreBody(toks, ""), operator).Engines["engine-a"]
		return e.HitTokens == 0 && e.Groups[0].PrefixTokens == 0 && e.Groups[1].UsableTokens == 48
	})
}
