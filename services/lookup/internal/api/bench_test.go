package api_test

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"slices"
	"testing"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/redis/go-redis/v9"

	"github.com/kvmesh/kvmesh/internal/devbroker"
	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
	"github.com/kvmesh/kvmesh/services/lookup/internal/api"
	"github.com/kvmesh/kvmesh/services/lookup/internal/connector"
)

// discard is a Publisher that drops decisions, to time a lookup without
// the broker round-trip.
type discard struct{}

func (discard) Publish(context.Context, ...bus.Message) error { return nil }

// BenchmarkLookup32K2Group times the lookup of a 32768-token prompt on the
// hybrid-mla-linear preset (MLA + Mamba: 4096 keys, every one present) in
// the real Redis. The baseline, exists_raw, is what the store offers at
// best without kvmesh's code: one raw go-redis pipeline of EXISTS of the
// plan's keys (so it does not move when kvstore gets faster); store_exists
// is kvstore.Redis.Exists of the same keys. The handler sub-benchmarks time
// the whole POST /v1/lookup (decode, hash or decode the hashes, plan, one
// Exists, resolve, decide), with the decision dropped or published to an
// embedded broker through a producer made as the service makes it
// (api.DecisionProducerOptions; the answer waits for the broker's ack, as
// the contract says). handler_block_hashes_* send the binary body
// (application/vnd.kvmesh.lookup: a JSON head line, then the raw hashes),
// the form a fast engine uses; handler_block_hashes_b64_* the compact JSON
// field, handler_block_hashes_hex_* the hex list and handler_token_ids_*
// the tokens. Each sub-benchmark reports p50-us and p99-us.
func BenchmarkLookup32K2Group(b *testing.B) {
	const numTokens = 32768
	ctx := context.Background()
	redisURL := testenv.RedisURL(b)
	m, err := kvcore.Preset("hybrid-mla-linear")
	if err != nil {
		b.Fatal(err)
	}
	st, err := kvstore.NewRedis(ctx, redisURL, kvstore.RedisOptions{})
	if err != nil {
		b.Fatal(err)
	}
	defer st.Close()
	kb := kvcore.KeysOf(m).WithPrefix("lookupbench")
	toks := make([]uint32, numTokens)
	for i := range toks {
		toks[i] = uint32(i*7919) % 151936
	}
	hashes := kvcore.HashChain(toks, m.HashBlockSize, nil)
	plan, err := kvcore.PlanLookup(m, kb, hashes, numTokens)
	if err != nil {
		b.Fatal(err)
	}
	keys := plan.Keys()
	seedAll(b, st, keys)

	b.Run("exists_raw", func(b *testing.B) { benchRawExists(b, redisURL, keys) })
	b.Run("store_exists", func(b *testing.B) {
		timed(b, func() {
			if found, err := st.Exists(ctx, keys); err != nil || !found[len(found)-1] {
				b.Fatalf("Exists: %v", err)
			}
		})
	})
	byHex := requestBody(b, m, map[string]any{"block_hashes": hexes(hashes), "num_tokens": numTokens})
	byB64 := requestBody(b, m, map[string]any{"block_hashes_b64": compact(hashes), "block_hash_bytes": len(hashes[0]), "num_tokens": numTokens})
	byTokens := requestBody(b, m, map[string]any{"token_ids": toks})
	byBinary := binaryBody(b, m, hashes, numTokens)
	want := numTokens - m.SchedulerBlockSize()
	for _, c := range []request{byBinary, byB64, byHex, byTokens} {
		b.Run("handler_"+c.name+"_no_publish", func(b *testing.B) {
			benchHandler(b, newRouter(b, m, kb, st, discard{}), c, want)
		})
	}
	br, err := devbroker.Start(ctx, devbroker.Config{Addr: "127.0.0.1:0", Partitions: 2})
	if err != nil {
		b.Fatal(err)
	}
	defer br.Close()
	p, err := bus.NewProducer(br.Addrs(), api.DecisionProducerOptions()...)
	if err != nil {
		b.Fatal(err)
	}
	defer p.Close()
	for _, c := range []request{byBinary, byB64, byHex} {
		b.Run("handler_"+c.name+"_published", func(b *testing.B) {
			benchHandler(b, newRouter(b, m, kb, st, p), c, want)
		})
	}
}

// benchRawExists times one go-redis pipeline of EXISTS per key, on a
// client of its own: the store's cost of the lookup's existence check.
func benchRawExists(b *testing.B, redisURL string, keys []string) {
	opts, err := redis.ParseURL(redisURL)
	if err != nil {
		b.Fatal(err)
	}
	rc := redis.NewClient(opts)
	defer rc.Close()
	ctx := context.Background()
	cmds := make([]*redis.IntCmd, len(keys))
	timed(b, func() {
		pipe := rc.Pipeline()
		for i, k := range keys {
			cmds[i] = pipe.Exists(ctx, k)
		}
		if _, err := pipe.Exec(ctx); err != nil || cmds[len(cmds)-1].Val() != 1 {
			b.Fatalf("pipelined EXISTS: %v", err)
		}
	})
}

// seedAll stores every key and removes them when the benchmark ends.
func seedAll(b *testing.B, st *kvstore.Redis, keys []string) {
	b.Helper()
	items := make([]kvstore.Item, len(keys))
	for i, k := range keys {
		items[i] = kvstore.Item{Key: k, Value: []byte{1}}
	}
	if _, err := st.Put(context.Background(), items); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _, _ = st.Remove(context.Background(), keys) })
}

// request is a lookup body and its Content-Type.
type request struct {
	name, contentType string
	body              []byte
}

// requestBody is a JSON lookup of fields; its name is the hash form.
func requestBody(b *testing.B, m *kvcore.Model, fields map[string]any) request {
	b.Helper()
	name := "token_ids"
	switch {
	case fields["block_hashes"] != nil:
		name = "block_hashes_hex"
	case fields["block_hashes_b64"] != nil:
		name = "block_hashes_b64"
	}
	fields["engine_id"], fields["request_id"], fields["model"] = "bench-engine", "bench-request", m.Name
	body, err := json.Marshal(fields)
	if err != nil {
		b.Fatal(err)
	}
	return request{name: name, contentType: "application/json", body: body}
}

// binaryBody is the binary lookup of hashes.
func binaryBody(b *testing.B, m *kvcore.Model, hashes []kvcore.BlockHash, numTokens int) request {
	b.Helper()
	req := requestBody(b, m, map[string]any{"block_hash_bytes": len(hashes[0]), "num_tokens": numTokens})
	body := append(req.body, '\n')
	for _, h := range hashes {
		body = append(body, h...)
	}
	return request{name: "block_hashes", contentType: api.ContentTypeBinary, body: body}
}

func newRouter(b *testing.B, m *kvcore.Model, kb kvcore.KeyBuilder, st kvstore.Store, p api.Publisher) http.Handler {
	b.Helper()
	chain, err := connector.NewChain(connector.NewStore(m, kb, st))
	if err != nil {
		b.Fatal(err)
	}
	h, err := api.New(api.Options{Model: m, Chain: chain, Publisher: p, Enabled: true, LoadAsync: true})
	if err != nil {
		b.Fatal(err)
	}
	r := chi.NewRouter()
	h.Mount(r)
	return r
}

func benchHandler(b *testing.B, h http.Handler, req request, want int) {
	b.SetBytes(int64(len(req.body)))
	timed(b, func() {
		rec := httptest.NewRecorder()
		hr := httptest.NewRequest(http.MethodPost, api.Route, bytes.NewReader(req.body))
		hr.Header.Set("Content-Type", req.contentType)
		h.ServeHTTP(rec, hr)
		if rec.Code != http.StatusOK {
			b.Fatalf("status %d: %s", rec.Code, rec.Body)
		}
		var d struct {
			ExternalTokens int `json:"external_tokens"`
		}
		if err := json.Unmarshal(rec.Body.Bytes(), &d); err != nil || d.ExternalTokens != want {
			b.Fatalf("external_tokens %d (%v), want %d", d.ExternalTokens, err, want)
		}
	})
}

// timed runs op in the benchmark loop and reports its p50 and p99.
func timed(b *testing.B, op func()) {
	b.ReportAllocs()
	var lat []time.Duration
	for b.Loop() {
		start := time.Now()
		op()
		lat = append(lat, time.Since(start))
	}
	slices.Sort(lat)
	pct := func(p float64) float64 {
		return float64(lat[int(p*float64(len(lat)-1))].Nanoseconds()) / 1e3
	}
	b.ReportMetric(pct(0.50), "p50-us")
	b.ReportMetric(pct(0.99), "p99-us")
}

// compact is the block_hashes_b64 form of hs.
func compact(hs []kvcore.BlockHash) string {
	var raw []byte
	for _, h := range hs {
		raw = append(raw, h...)
	}
	return base64.StdEncoding.EncodeToString(raw)
}

func hexes(hs []kvcore.BlockHash) []string {
	out := make([]string, len(hs))
	for i, h := range hs {
		out[i] = h.Hex()
	}
	return out
}
