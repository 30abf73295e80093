package app_test

import (
	"encoding/json"
	"reflect"
	"testing"

	"github.com/kvmesh/kvmesh/internal/servicetest"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// The lookup scenarios of docs/architecture.md (1, 3, 4,
// 5, 6 and 21), driven over HTTP against running lookup services whose
// keys are pre-seeded in the real Redis.

// body is a lookup request by token ids.
func body(requestID string, toks []uint32, computed int) map[string]any {
	return map[string]any{
		"engine_id": "engine-0", "request_id": requestID, "model": "test-model",
		"token_ids": toks, "num_computed_tokens": computed,
	}
}

// expect is the part of an answer a scenario checks.
type expect struct {
	external  int
	loadAsync bool
	chosen    string
	children  []contract.ChildDecision
}

func (e expect) check(t *testing.T, d contract.LookupDecision) {
	t.Helper()
	if d.ExternalTokens != e.external || d.LoadAsync != e.loadAsync || d.Chosen != e.chosen || d.Pending {
		t.Errorf("answer external %d async %v chosen %q pending %v; want %d %v %q false",
			d.ExternalTokens, d.LoadAsync, d.Chosen, d.Pending, e.external, e.loadAsync, e.chosen)
	}
	if !reflect.DeepEqual(d.Children, e.children) {
		t.Errorf("children %s, want %s", asJSON(d.Children), asJSON(e.children))
	}
	if d.DecisionID == "" || d.Schema != contract.SchemaLookupDecision {
		t.Errorf("decision id %q schema %q", d.DecisionID, d.Schema)
	}
}

// asJSON formats v for failure messages.
func asJSON(v any) string {
	b, _ := json.Marshal(v) // test values always marshal
	return string(b)
}

func store(tokens int, spec *kvcore.LoadSpec) contract.ChildDecision {
	return contract.ChildDecision{Name: "store", Tokens: tokens, Spec: spec}
}

// lookupCounting runs one lookup and returns the answer with how many
// existence calls and keys it cost the service.
func lookupCounting(t *testing.T, s *lookupService, b any) (contract.LookupDecision, float64, float64) {
	t.Helper()
	calls, keys := s.metric(t, existsCalls), s.metric(t, existsKeys)
	d := s.lookup(t, b)
	return d, s.metric(t, existsCalls) - calls, s.metric(t, existsKeys) - keys
}

func TestLookupScenarios(t *testing.T) {
	env := servicetest.NewEnv(t)
	seed := newSeeder(t, env.RedisURL)
	dense := writeSpec(t, specDense)
	storeOnly := startLookup(t, env, map[string]string{"KVMESH_MODEL": dense})

	t.Run("S01_disabled_answers_0_without_the_store", func(t *testing.T) {
		off := startLookup(t, env, map[string]string{"KVMESH_MODEL": dense, "KVMESH_LOOKUP_ENABLED": "false"})
		toks := tokens(48, 101)
		seed.put(t, groupKeys(off.keys(), 0, kvcore.HashChain(toks, 16, nil), 0, 1, 2)...)
		d, calls, _ := lookupCounting(t, off, body("s1-off", toks, 0))
		expect{children: []contract.ChildDecision{}}.check(t, d)
		if calls != 0 {
			t.Errorf("disabled lookup made %v existence calls, want 0", calls)
		}
	})
	t.Run("S01_short_prompt_answers_0_without_the_store", func(t *testing.T) {
		d, calls, _ := lookupCounting(t, storeOnly, body("s1-short", tokens(12, 102), 0))
		expect{children: []contract.ChildDecision{store(0, nil)}}.check(t, d)
		if calls != 0 {
			t.Errorf("12-token lookup made %v existence calls, want 0", calls)
		}
	})
	t.Run("S03_full_hit_rule_one_round_trip", func(t *testing.T) {
		toks := tokens(48, 103)
		hashes := kvcore.HashChain(toks, 16, nil)
		seed.put(t, groupKeys(storeOnly.keys(), 0, hashes, 0, 1)...) // exists [1,1,0]
		cases := []struct {
			name string
			body map[string]any
			want int
		}{
			{"48_tokens_110", body("s3-48", toks, 0), 32},
			{"32_tokens_11", body("s3-32", toks[:32], 0), 16},
			{"33_tokens_11", body("s3-33", toks[:33], 0), 32},
			{"32_tokens_by_block_hashes", map[string]any{
				"engine_id": "engine-0", "request_id": "s3-32h", "model": "test-model",
				"block_hashes": hexes(hashes[:2]), "num_tokens": 32}, 16},
		}
		for _, tc := range cases {
			t.Run(tc.name, func(t *testing.T) {
				d, calls, _ := lookupCounting(t, storeOnly, tc.body)
				expect{external: tc.want, loadAsync: true, chosen: "store",
					children: []contract.ChildDecision{store(tc.want, &kvcore.LoadSpec{KVPoolCachedTokens: tc.want})}}.check(t, d)
				if calls != 1 {
					t.Errorf("%v existence round-trips, want exactly 1", calls)
				}
			})
		}
	})
	t.Run("S03_salt_changes_the_keys", func(t *testing.T) {
		toks := tokens(48, 104)
		seed.put(t, groupKeys(storeOnly.keys(), 0, kvcore.HashChain(toks, 16, []byte("lora-7")), 0, 1, 2)...)
		salted := body("s3-salted", toks, 0)
		salted["extra"] = "lora-7"
		expect{external: 32, loadAsync: true, chosen: "store",
			children: []contract.ChildDecision{store(32, &kvcore.LoadSpec{KVPoolCachedTokens: 32})}}.check(t, storeOnly.lookup(t, salted))
		expect{children: []contract.ChildDecision{store(0, nil)}}.check(t, storeOnly.lookup(t, body("s3-unsalted", toks, 0)))
	})
	t.Run("S06_need_and_load_spec", func(t *testing.T) {
		toks := tokens(48, 106)
		seed.put(t, groupKeys(storeOnly.keys(), 0, kvcore.HashChain(toks, 16, nil), 0, 1)...)
		syncBody := body("s6-sync", toks, 16)
		syncBody["load_async"] = false
		spec := &kvcore.LoadSpec{VLLMCachedTokens: 16, KVPoolCachedTokens: 32}
		cases := []struct {
			name string
			body map[string]any
			want expect
		}{
			{"hit32_computed16", body("s6-16", toks, 16), expect{16, true, "store", []contract.ChildDecision{store(16, spec)}}},
			{"hit32_computed32", body("s6-32", toks, 32), expect{children: []contract.ChildDecision{store(0, nil)}}},
			{"12_tokens", body("s6-12", toks[:12], 0), expect{children: []contract.ChildDecision{store(0, nil)}}},
			{"load_async_override", syncBody, expect{16, false, "store", []contract.ChildDecision{store(16, spec)}}},
		}
		for _, tc := range cases {
			t.Run(tc.name, func(t *testing.T) { tc.want.check(t, storeOnly.lookup(t, tc.body)) })
		}
	})
	t.Run("S21_multiconnector_pd_then_store", func(t *testing.T) {
		scenarioMultiConnector(t, startLookup(t, env, map[string]string{"KVMESH_MODEL": dense, "KVMESH_LOOKUP_CONNECTORS": "pd,store"}), seed)
	})
}

func scenarioMultiConnector(t *testing.T, s *lookupService, seed *seeder) {
	toks := tokens(48, 121)
	seed.put(t, groupKeys(s.keys(), 0, kvcore.HashChain(toks, 16, nil), 0, 1)...)
	src := &contract.PDSource{EngineID: "prefill-0", BlockTable: kvcore.BlockTable{{7, 8, 9}}, Tokens: 48}
	withPD := func(b map[string]any) map[string]any {
		b["kv_transfer_params"] = src
		return b
	}
	spec := &kvcore.LoadSpec{KVPoolCachedTokens: 32}
	pd := func(n int, sp *kvcore.LoadSpec) contract.ChildDecision {
		return contract.ChildDecision{Name: "pd", Tokens: n, Spec: sp}
	}

	d := s.lookup(t, body("s21-store", toks, 0))
	expect{32, true, "store", []contract.ChildDecision{pd(0, nil), store(32, spec)}}.check(t, d)
	if d.PD != nil {
		t.Errorf("store chosen but pd_source %+v", d.PD)
	}

	d = s.lookup(t, withPD(body("s21-pd", toks, 0)))
	expect{32, true, "pd", []contract.ChildDecision{pd(32, spec), store(32, spec)}}.check(t, d)
	if !reflect.DeepEqual(d.PD, src) {
		t.Errorf("pd_source %+v, want %+v", d.PD, src)
	}
	// After allocation the store child gets 0: its LoadSpec ends with
	// can_load false and no load (scenario 9, the scheduler's part).
	answers := make([]kvcore.ChildAnswer, len(d.Children))
	for i, c := range d.Children {
		answers[i] = kvcore.ChildAnswer{Name: c.Name, Tokens: c.Tokens, Spec: c.Spec}
	}
	if got := kvcore.AllocationCounts(0, answers, d.ExternalTokens); !reflect.DeepEqual(got, []int{32, 0}) {
		t.Errorf("allocation counts %v, want [32 0]", got)
	}

	d = s.lookup(t, withPD(body("s21-pd-only", tokens(48, 122), 0)))
	expect{32, true, "pd", []contract.ChildDecision{pd(32, spec), store(0, nil)}}.check(t, d)
}

func TestLookupScenariosHybrid(t *testing.T) {
	env := servicetest.NewEnv(t)
	seed := newSeeder(t, env.RedisURL)

	t.Run("S04_full_plus_mamba", func(t *testing.T) {
		s := startLookup(t, env, map[string]string{"KVMESH_MODEL": writeSpec(t, specFullMamba)})
		kb := s.keys()
		all := tokens(33, 141)
		h := kvcore.HashChain(all, 16, nil)
		seed.put(t, append(groupKeys(kb, 0, h, 0, 1), groupKeys(kb, 1, h, 0, 1)...)...)
		d, calls, keys := lookupCounting(t, s, body("s4-all", all, 0))
		expect{32, true, "store", []contract.ChildDecision{store(32, &kvcore.LoadSpec{KVPoolCachedTokens: 32})}}.check(t, d)
		if calls != 1 || keys != 4 {
			t.Errorf("%v existence calls over %v keys, want 1 call over 4 keys (2 groups x 2 chunks)", calls, keys)
		}

		holed := tokens(33, 142)
		h = kvcore.HashChain(holed, 16, nil)
		seed.put(t, append(groupKeys(kb, 0, h, 1), groupKeys(kb, 1, h, 0, 1)...)...) // full chunk [0,16) missing
		expect{children: []contract.ChildDecision{store(0, nil)}}.check(t, s.lookup(t, body("s4-hole", holed, 0)))
	})
	t.Run("S05_full_plus_sliding_window", func(t *testing.T) {
		s := startLookup(t, env, map[string]string{"KVMESH_MODEL": writeSpec(t, specFullSWA)})
		kb := s.keys()
		toks := tokens(65, 151)
		h := kvcore.HashChain(toks, 8, nil)
		// Only the 2 full keys and the window-reachable SWA keys ([24,32) and [56,64)).
		seed.put(t, append(groupKeys(kb, 0, h, 3, 7), groupKeys(kb, 1, h, 3, 7)...)...)
		d, calls, keys := lookupCounting(t, s, body("s5-64", toks[:64], 0))
		expect{32, true, "store", []contract.ChildDecision{store(32, &kvcore.LoadSpec{KVPoolCachedTokens: 32})}}.check(t, d)
		if calls != 1 || keys != 4 {
			t.Errorf("64 tokens: %v existence calls over %v keys, want 1 over 4", calls, keys)
		}
		full := expect{64, true, "store", []contract.ChildDecision{store(64, &kvcore.LoadSpec{KVPoolCachedTokens: 64})}}
		full.check(t, s.lookup(t, body("s5-65", toks, 0)))
		seed.remove(t, groupKeys(kb, 1, h, 3)...) // out of the window at 64
		full.check(t, s.lookup(t, body("s5-65-swa-gone", toks, 0)))
	})
}
