package kvcore

import (
	"reflect"
	"slices"
	"testing"
)

// The MultiConnector scenarios of issue 14: a store outage during lookup
// fails open per child. They follow vLLM's store child and chain:
//
//   - MooncakeStoreWorker.lookup
//     (vllm/backends/distributed/kv_transfer/kv_connector/v1/mooncake/store/worker.py,
//     commit 055e47c28003156421365af985d676fc921cb075): a raising
//     store.batch_is_exist is recorded as a failed lookup_exists operation,
//     logged, and answered MooncakeLookupResult(0);
//   - LookupKeyClient.lookup (same file): a lookup call that raises is
//     logged and answered MooncakeLookupResult(0), never None ("not yet");
//   - MooncakeStoreScheduler.get_num_new_matched_tokens
//     (.../mooncake/store/scheduler.py, commit
//     a8f1d79812aa51e1036eba41286879eb09bd1635): a hit of 0 needs nothing
//     and answers (0, False);
//   - MultiConnector.get_num_new_matched_tokens
//     (.../kv_connector/v1/multi_connector.py, commit
//     055e47c28003156421365af985d676fc921cb075): every child is asked, the
//     first with a positive count is chosen, so a pd hit after a failed
//     store still wins.

func TestScenariosMulti(t *testing.T) {
	scenarios := []struct {
		name     string
		children []ChildAnswer
		want     Selection
		// alloc is AllocationCounts(want.Chosen, children, want.Tokens).
		alloc []int
	}{
		// S70: the store alone, its check failed: 0 external tokens, not
		// "not yet" (the lookup answers 200 with 0, not 503).
		{"S70_store_only_outage_answers_zero",
			[]ChildAnswer{{Name: "store", Failed: true}},
			Selection{Chosen: NoChild}, []int{0}},
		// S71: chain pd,store (make run's): the pd child's 32 tokens win
		// while the store is down.
		{"S71_pd_hit_wins_over_failed_store_pd_first",
			[]ChildAnswer{{Name: "pd", Tokens: 32, Spec: &LoadSpec{KVPoolCachedTokens: 32}}, {Name: "store", Failed: true}},
			Selection{Chosen: 0, Tokens: 32}, []int{32, 0}},
		// S72: chain store,pd: the failed store answers 0 and the chain
		// goes on to the pd child's 48.
		{"S72_pd_hit_wins_over_failed_store_store_first",
			[]ChildAnswer{{Name: "store", Failed: true}, {Name: "pd", Tokens: 48}},
			Selection{Chosen: 1, Tokens: 48}, []int{0, 48}},
		// S73: a failed child's count is never used, even if one was set.
		{"S73_failed_child_never_wins_with_tokens",
			[]ChildAnswer{{Name: "store", Tokens: 64, Failed: true}, {Name: "pd", Tokens: 16}},
			Selection{Chosen: 1, Tokens: 16}, []int{0, 16}},
		// S74: a failed lookup is never "not yet" (LookupKeyClient.lookup
		// answers 0 when the future raised, only None while it runs).
		{"S74_failed_child_is_never_pending",
			[]ChildAnswer{{Name: "store", Pending: true, Failed: true}, {Name: "pd", Tokens: 16}},
			Selection{Chosen: 1, Tokens: 16}, []int{0, 16}},
		// S75: a failed child does not hide another child's "not yet".
		{"S75_failed_child_keeps_another_pending",
			[]ChildAnswer{{Name: "store", Failed: true}, {Name: "pd", Pending: true}},
			Selection{Pending: true, Chosen: NoChild}, []int{0, 0}},
		// S76: the store and pd both miss during the outage: 0.
		{"S76_failed_store_and_pd_miss_answer_zero",
			[]ChildAnswer{{Name: "pd"}, {Name: "store", Failed: true}},
			Selection{Chosen: NoChild}, []int{0, 0}},
		// S77: the store is back: its hit is chosen again (first positive,
		// store first), the pd child's larger count notwithstanding.
		{"S77_recovered_store_hits_again",
			[]ChildAnswer{{Name: "store", Tokens: 32}, {Name: "pd", Tokens: 48}},
			Selection{Chosen: 0, Tokens: 32}, []int{32, 0}},
	}
	for _, sc := range scenarios {
		t.Run(sc.name, func(t *testing.T) {
			in := slices.Clone(sc.children)
			got := SelectChild(sc.children)
			if got != sc.want {
				t.Fatalf("SelectChild = %+v, want %+v", got, sc.want)
			}
			if !reflect.DeepEqual(sc.children, in) {
				t.Fatalf("SelectChild changed its input: %+v", sc.children)
			}
			if alloc := AllocationCounts(got.Chosen, sc.children, got.Tokens); !slices.Equal(alloc, sc.alloc) {
				t.Fatalf("AllocationCounts = %v, want %v", alloc, sc.alloc)
			}
			if name := got.Name(sc.children); got.Chosen >= 0 && sc.children[got.Chosen].Failed {
				t.Fatalf("chose the failed child %q", name)
			}
		})
	}
}
