package api_test

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"slices"
	"testing"
	"time"

	"github.com/go-chi/chi/v5"

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
// the real Redis: the raw pipelined Exists of the plan's keys, next to the
// whole POST /v1/lookup handler (decode, hash or parse, plan, one Exists,
// resolve, decide) with the decision dropped and with it published to an
// embedded broker. Each sub-benchmark reports p50-us and p99-us.
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
	kb := kvcore.KeyBuilder{Prefix: "lookupbench", Model: m.Name}
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

	b.Run("exists_raw", func(b *testing.B) {
		timed(b, func() {
			if found, err := st.Exists(ctx, keys); err != nil || !found[len(found)-1] {
				b.Fatalf("Exists: %v", err)
			}
		})
	})
	byHashes := requestBody(b, m, map[string]any{"block_hashes": hexes(hashes), "num_tokens": numTokens})
	byTokens := requestBody(b, m, map[string]any{"token_ids": toks})
	want := numTokens - m.SchedulerBlockSize()
	b.Run("handler_block_hashes_no_publish", func(b *testing.B) {
		benchHandler(b, newRouter(b, m, kb, st, discard{}), byHashes, want)
	})
	b.Run("handler_token_ids_no_publish", func(b *testing.B) {
		benchHandler(b, newRouter(b, m, kb, st, discard{}), byTokens, want)
	})
	b.Run("handler_block_hashes_published", func(b *testing.B) {
		br, err := devbroker.Start(ctx, devbroker.Config{Addr: "127.0.0.1:0", Partitions: 2})
		if err != nil {
			b.Fatal(err)
		}
		defer br.Close()
		p, err := bus.NewProducer(br.Addrs())
		if err != nil {
			b.Fatal(err)
		}
		defer p.Close()
		benchHandler(b, newRouter(b, m, kb, st, p), byHashes, want)
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

func requestBody(b *testing.B, m *kvcore.Model, fields map[string]any) []byte {
	b.Helper()
	fields["engine_id"], fields["request_id"], fields["model"] = "bench-engine", "bench-request", m.Name
	body, err := json.Marshal(fields)
	if err != nil {
		b.Fatal(err)
	}
	return body
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

func benchHandler(b *testing.B, h http.Handler, body []byte, want int) {
	b.SetBytes(int64(len(body)))
	timed(b, func() {
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, api.Route, bytes.NewReader(body)))
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

func hexes(hs []kvcore.BlockHash) []string {
	out := make([]string, len(hs))
	for i, h := range hs {
		out[i] = h.Hex()
	}
	return out
}
