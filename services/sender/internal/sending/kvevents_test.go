package sending_test

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvmesh/kvmesh/internal/dbtest"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
	"github.com/kvmesh/kvmesh/services/sender/internal/ledger"
	"github.com/kvmesh/kvmesh/services/sender/internal/sending"
	"github.com/kvmesh/kvmesh/services/sender/internal/sendpolicy"
)

// kvRecords decodes the kvmesh.kv.events records in the outbox, in order,
// with their record keys.
func (f *fixture) kvRecords(t testing.TB) ([]contract.KVEventRecord, []string) {
	t.Helper()
	rows, err := f.pool.Query(context.Background(), "SELECT key, value, headers FROM outbox WHERE topic = $1 ORDER BY id", contract.TopicKVEvents)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var recs []contract.KVEventRecord
	var keys []string
	for rows.Next() {
		var key string
		var value []byte
		var headers map[string]string
		if err := rows.Scan(&key, &value, &headers); err != nil {
			t.Fatal(err)
		}
		rec, err := contract.DecodeKVEventRecord(value, headers)
		if err != nil {
			t.Fatal(err)
		}
		recs, keys = append(recs, rec), append(keys, key)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return recs, keys
}

func wire(t *testing.T, hexHash string) uint64 {
	t.Helper()
	h, err := kvcore.ParseBlockHash(hexHash)
	if err != nil {
		t.Fatal(err)
	}
	return contract.WireHash(h)
}

// TestBlockStoredRecordsFollowVLLM checks the BlockStored records of a
// save whose second chunk already existed: one record per group and
// namespace, keyed by the namespace, announcing the chunks it put and the
// existing one before them — so the run does not hang from a parent only
// another save's record announces — as one vLLM
// BlockStored event per run of consecutive chunks whose parent is the
// chunk before it, with the group's block size, kind and kvmesh's medium.
func TestBlockStoredRecordsFollowVLLM(t *testing.T) {
	store := kvstore.NewMemory(kvstore.MemoryOptions{})
	f := newFixture(t, dbtest.NewPool(t), store)
	task := saveTask(f.model, "kv1", 0, 64, 3)
	existing := f.keysOf(t, task, 0)[1] // the MLA chunk [16,32)
	if _, err := store.Put(context.Background(), []kvstore.Item{{Key: existing, Value: []byte("x")}}); err != nil {
		t.Fatal(err)
	}
	f.handle(t, encode(t, task))

	recs, keys := f.kvRecords(t)
	if len(recs) != 2 {
		t.Fatalf("%d kv event records, want one per group (one namespace each)", len(recs))
	}
	h := task.BlockHashes
	mla, mamba := recs[0], recs[1]
	if keys[0] != f.keys.Namespace(kvcore.Rank{}, 0) || mla.Namespace != keys[0] || mla.Model != f.model.Name ||
		mla.EngineID != task.EngineID || mla.RequestID != task.RequestID || mla.Kind() != contract.BlockStored {
		t.Fatalf("MLA record key %q: %+v", keys[0], mla)
	}
	if want := []string{h[0], h[1], h[2], h[3]}; !slices.Equal(mla.Hashes, want) {
		t.Fatalf("MLA hashes %v, want chunks 0 to 3 (1 existed, and is held)", mla.Hashes)
	}
	if len(mla.Batch.Events) != 1 {
		t.Fatalf("MLA events %+v, want one run [0,3]", mla.Batch.Events)
	}
	if run := mla.Batch.Events[0]; run.ParentBlockHash != nil ||
		!slices.Equal(run.BlockHashes, []uint64{wire(t, h[0]), wire(t, h[1]), wire(t, h[2]), wire(t, h[3])}) {
		t.Errorf("run %+v, want chunks 0 to 3 with no parent", run)
	}
	for _, e := range mla.Batch.Events {
		if e.BlockSize != 16 || *e.GroupIdx != 0 || e.SpecKind != "mla_attention" || *e.Medium != contract.MediumStore ||
			len(e.TokenIDs) != 0 || e.LoraID != nil || e.LoraName != nil || e.ExtraKeys != nil || e.SlidingWindow != nil ||
			e.Locality == nil || *e.Locality != contract.LocalityStore {
			t.Errorf("MLA event fields %+v", e)
		}
	}
	ms := mamba.Batch.Events
	if len(ms) != 1 || *ms[0].GroupIdx != 1 || ms[0].SpecKind != "mamba" || !slices.Equal(mamba.Hashes, []string{h[3]}) ||
		*ms[0].Medium != contract.MediumStore || ms[0].Locality == nil || *ms[0].Locality != contract.LocalityStore || ms[0].SlidingWindow != nil ||
		ms[0].ParentBlockHash == nil || *ms[0].ParentBlockHash != wire(t, h[2]) || keys[1] != f.keys.Namespace(kvcore.Rank{}, 1) {
		t.Errorf("Mamba record key %q: %+v", keys[1], mamba)
	}
	if got := append(mla.Keys(), mamba.Keys()...); !slices.Equal(got, append(f.keysOf(t, task, 0), f.keysOf(t, task, 1)[0])) {
		t.Errorf("store keys of the records %v", got)
	}
	if want := contract.UnixSeconds(f.now); mla.Batch.TS != want {
		t.Errorf("batch ts %v, want the processor's clock %v", mla.Batch.TS, want)
	}
}

// swaModel is a full-attention + sliding-window model (gemma's shape) with
// tiny blocks.
const swaModel = `
name: small-swa
hash_block_size: 16
groups:
  - {kind: full_attention, block_size: 16, bytes_per_block: 64}
  - {kind: sliding_window, block_size: 16, window: 40, bytes_per_block: 64}
`

// newModelFixture is newFixture with the model of spec.
func newModelFixture(t testing.TB, spec string) *fixture {
	t.Helper()
	m, err := kvcore.ParseModel([]byte(spec))
	if err != nil {
		t.Fatal(err)
	}
	store, pool := kvstore.NewMemory(kvstore.MemoryOptions{}), dbtest.NewPool(t)
	f := &fixture{model: m, keys: kvcore.KeysOf(m), store: store, pool: pool, ledger: ledger.New(pool),
		worker: &poolWorker{model: m, store: store, blocks: 64}, now: time.Unix(1_800_000_000, 0)}
	metrics, err := sending.NewMetrics(prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	f.p, err = sending.New(sending.Options{
		Model: m, Keys: f.keys, Store: store, Workers: engines{"e1": f.worker}, Ledger: f.ledger, Metrics: metrics,
		Retry: sendpolicy.RetryPolicy{MaxAttempts: 3, BaseDelay: time.Millisecond, MaxDelay: 2 * time.Millisecond},
		Now:   func() time.Time { return f.now },
	})
	if err != nil {
		t.Fatal(err)
	}
	return f
}

// TestBlockStoredRecordsSlidingWindow checks the vLLM fields kvmesh fills
// from the model spec on a sliding-window model: each group's BlockStored
// events carry its group_idx and kv_cache_spec_kind, the sliding-window
// group's also its window as kv_cache_spec_sliding_window (the full
// group's none), the store's medium and locality, and no LoRA or extra
// keys, which a save task does not carry.
func TestBlockStoredRecordsSlidingWindow(t *testing.T) {
	f := newModelFixture(t, swaModel)
	task := saveTask(f.model, "swa1", 0, 64, 3)
	f.handle(t, encode(t, task))

	recs, keys := f.kvRecords(t)
	if len(recs) != 2 {
		t.Fatalf("%d kv event records, want one per group", len(recs))
	}
	for g, rec := range recs {
		if keys[g] != f.keys.Namespace(kvcore.Rank{}, g) || rec.Kind() != contract.BlockStored || len(rec.Batch.Events) == 0 {
			t.Fatalf("group %d record key %q: %+v", g, keys[g], rec)
		}
		for _, e := range rec.Batch.Events {
			if e.GroupIdx == nil || *e.GroupIdx != g || e.BlockSize != 16 || e.Medium == nil || *e.Medium != contract.MediumStore ||
				e.Locality == nil || *e.Locality != contract.LocalityStore || e.LoraID != nil || e.LoraName != nil || e.ExtraKeys != nil {
				t.Errorf("group %d event fields %+v", g, e)
			}
		}
	}
	full, swa := recs[0].Batch.Events[0], recs[1].Batch.Events[0]
	if full.SpecKind != "full_attention" || full.SlidingWindow != nil {
		t.Errorf("full-attention event: kind %q, window %v; want full_attention and no window", full.SpecKind, full.SlidingWindow)
	}
	if swa.SpecKind != "sliding_window" || swa.SlidingWindow == nil || *swa.SlidingWindow != 40 {
		t.Errorf("sliding-window event: kind %q, window %v; want sliding_window, 40", swa.SpecKind, swa.SlidingWindow)
	}
}

// bigBlockModel has blocks of two hash blocks (32 tokens, hash blocks of
// 16): one BlockStored block covers two hashes, the second its key.
const bigBlockModel = `
name: big-blocks
hash_block_size: 16
groups:
  - {kind: full_attention, block_size: 32, bytes_per_block: 64}
`

// partialModel has Mamba blocks of two hash blocks: vLLM's partial hash
// hits, under which a prompt's sub-block tail is stored at its last hash
// boundary inside a block.
const partialModel = `
name: partial-hits
hash_block_size: 16
groups:
  - {kind: full_attention, block_size: 32, bytes_per_block: 64}
  - {kind: mamba, block_size: 32, bytes_per_block: 96}
`

// promptTokens are the tokens saveTask hashed for a task of request id
// (its chain is theirs), n of them.
func promptTokens(id string, n int) []uint32 {
	tokens := make([]uint32, n)
	for i := range tokens {
		tokens[i] = uint32(len(id)*7919 + int(id[len(id)-1])*31 + i)
	}
	return tokens
}

// TestBlockStoredTokenIDs checks each BlockStored event's token_ids: the
// tokens of exactly its blocks (len(block_hashes) × the group's block
// size, in order), from the task's tokens, and [] for an event with a
// block the task's tokens do not cover whole; a run the tokens end inside
// is split there, the covered blocks keeping their tokens and the rest
// hanging from the last of them; every event names the task's LoRA
// adapter.
func TestBlockStoredTokenIDs(t *testing.T) {
	cases := []struct {
		name       string
		spec       string
		start, end int
		tokens     int // the task's token ids, [0, tokens)
		tail       bool
		// want are, per record (group) and event, the token ranges
		// [from, to) of the event's token_ids; {0, 0} is [].
		want [][][2]int
	}{
		{"hash-block blocks", smallModel, 0, 64, 64, false,
			[][][2]int{{{0, 64}}, {{48, 64}}}},
		{"tokens end inside the run", smallModel, 0, 64, 48, false,
			[][][2]int{{{0, 48}, {0, 0}}, {{0, 0}}}},
		{"no tokens", smallModel, 0, 64, 0, false,
			[][][2]int{{{0, 0}}, {{0, 0}}}},
		{"blocks of two hash blocks", bigBlockModel, 0, 96, 96, false,
			[][][2]int{{{0, 96}}}},
		{"a later save carries the tokens from 0", bigBlockModel, 32, 96, 96, false,
			[][][2]int{{{32, 96}}}},
		{"sub-block prompt tail", partialModel, 32, 48, 48, true,
			[][][2]int{{{0, 0}}, {{0, 0}}}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			f := newModelFixture(t, c.spec)
			id := "tok-" + strings.ReplaceAll(c.name, " ", "-")
			task := saveTask(f.model, id, c.start, c.end, 3)
			if c.tail {
				task.Groups = f.model.PromptTailGroups(c.start, c.end)
				task.BlockTable = kvcore.BlockTable{{3, 4}, {3, 4}}
			}
			task.TokenIDs, task.LoraName = promptTokens(id, c.tokens), "sql-lora"
			f.handle(t, encode(t, task))
			if r, ok := f.outcome(t, task.TaskID); !ok || r.Status != string(kvcore.SaveStored) {
				t.Fatalf("outcome %+v (%v), want stored", r, ok)
			}
			recs, _ := f.kvRecords(t)
			if len(recs) != len(c.want) {
				t.Fatalf("%d records, want %d", len(recs), len(c.want))
			}
			all := promptTokens(id, c.end)
			for g, rec := range recs {
				if len(rec.Batch.Events) != len(c.want[g]) {
					t.Fatalf("group %d: %d events, want %d", g, len(rec.Batch.Events), len(c.want[g]))
				}
				for i, e := range rec.Batch.Events {
					r := c.want[g][i]
					if !slices.Equal(e.TokenIDs, all[r[0]:r[1]]) || e.TokenIDs == nil {
						t.Errorf("group %d event %d: %d token ids, want [%d,%d)", g, i, len(e.TokenIDs), r[0], r[1])
					}
					if n := len(e.TokenIDs); n != 0 && n != len(e.BlockHashes)*e.BlockSize {
						t.Errorf("group %d event %d: %d token ids for %d blocks of %d", g, i, n, len(e.BlockHashes), e.BlockSize)
					}
					if i > 0 { // a split run: the rest hangs from the covered blocks' last
						prev := rec.Batch.Events[i-1].BlockHashes
						if e.ParentBlockHash == nil || *e.ParentBlockHash != prev[len(prev)-1] {
							t.Errorf("group %d event %d: parent %v, want the last block of event %d", g, i, e.ParentBlockHash, i-1)
						}
					}
					if e.LoraName == nil || *e.LoraName != "sql-lora" || e.LoraID != nil {
						t.Errorf("group %d event %d: lora_name %v, lora_id %v; want sql-lora, nil", g, i, e.LoraName, e.LoraID)
					}
				}
			}
		})
	}
}
