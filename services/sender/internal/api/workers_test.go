package api_test

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/internal/dbtest"
	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/adminapi"
	"github.com/kvmesh/kvmesh/pkg/httpserver"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/registry"
	"github.com/kvmesh/kvmesh/services/sender/internal/api"
)

func TestListWorkers(t *testing.T) {
	pool := dbtest.NewPool(t)
	ctx := context.Background()
	var want []string // engine/rank in list order
	for _, e := range []string{"engine-a", "engine-b"} {
		for tp := range 3 {
			w := registry.Worker{EngineID: e, Rank: kvcore.Rank{TP: tp}, Addr: fmt.Sprintf("http://10.0.0.%d:8084", tp)}
			if err := registry.Register(ctx, pool, w); err != nil {
				t.Fatal(err)
			}
			want = append(want, fmt.Sprintf("%s/tp%d", e, tp))
		}
	}
	// engine-b tp1 last heartbeat an hour ago: stale.
	if _, err := pool.Exec(ctx, `UPDATE workers SET heartbeat_at = now() - interval '1 hour' WHERE engine_id = 'engine-b' AND tp = 1`); err != nil {
		t.Fatal(err)
	}
	base := serve(t, api.New(nil, nil, registry.NewView(pool, 30*time.Second), slog.New(slog.DiscardHandler)))
	names := func(p api.WorkerPage) []string {
		var out []string
		for _, w := range p.Items {
			out = append(out, fmt.Sprintf("%s/tp%d", w.EngineID, w.Rank.TP))
		}
		return out
	}

	var all api.WorkerPage
	if code := testenv.CallJSON(t, http.MethodGet, base+"/v1/workers", "", &all); code != http.StatusOK || !slices.Equal(names(all), want) ||
		all.NextCursor != "" || all.StaleAfterSeconds != 30 {
		t.Fatalf("list: %d %v %q %v, want %v and no cursor", code, names(all), all.NextCursor, all.StaleAfterSeconds, want)
	}
	for _, w := range all.Items {
		stale := w.EngineID == "engine-b" && w.Rank.TP == 1
		if w.Alive == stale || (w.State == adminapi.WorkerStale) != stale || (w.HeartbeatAgeSeconds > 3000) != stale ||
			w.Addr != fmt.Sprintf("http://10.0.0.%d:8084", w.Rank.TP) || string(w.Devices) != "{}" {
			t.Errorf("worker %+v (stale %v)", w, stale)
		}
	}

	t.Run("pages", func(t *testing.T) {
		var seen []string
		cursor := ""
		for pages := 0; ; pages++ {
			if pages > len(want) {
				t.Fatal("pagination does not end")
			}
			var p api.WorkerPage
			if code := testenv.CallJSON(t, http.MethodGet, base+"/v1/workers?limit=4&cursor="+cursor, "", &p); code != http.StatusOK || len(p.Items) > 4 {
				t.Fatalf("page %d: %d, %d items", pages, code, len(p.Items))
			}
			seen = append(seen, names(p)...)
			if p.NextCursor == "" {
				break
			}
			cursor = p.NextCursor
		}
		if !slices.Equal(seen, want) {
			t.Fatalf("pages gave %v, want %v", seen, want)
		}
	})

	t.Run("filters", func(t *testing.T) {
		tests := []struct {
			query string
			want  []string
		}{
			{"engine_id=engine-a", want[:3]},
			{"engine_id=nobody", nil},
			{"state=stale", []string{"engine-b/tp1"}},
			{"state=alive&engine_id=engine-b", []string{"engine-b/tp0", "engine-b/tp2"}},
			{"state=alive&limit=1&engine_id=engine-b", []string{"engine-b/tp0"}},
		}
		for _, tt := range tests {
			var p api.WorkerPage
			if code := testenv.CallJSON(t, http.MethodGet, base+"/v1/workers?"+tt.query, "", &p); code != http.StatusOK || !slices.Equal(names(p), tt.want) {
				t.Errorf("?%s: %d %v, want %v", tt.query, code, names(p), tt.want)
			}
		}
	})

	t.Run("bad parameters", func(t *testing.T) {
		for query, param := range map[string]string{
			"limit=0": "limit", "limit=1001": "limit", "limit=x": "limit",
			"cursor=abc": "cursor", "cursor=" + httpserver.EncodeCursor(map[string]int{"t": 1}): "cursor",
			"state=dead": "state",
		} {
			var prob httpserver.Problem
			if code := testenv.CallJSON(t, http.MethodGet, base+"/v1/workers?"+query, "", &prob); code != http.StatusBadRequest || prob.Extras["parameter"] != param {
				t.Errorf("?%s: %d %+v, want 400 naming %s", query, code, prob, param)
			}
		}
	})
}
