package dlqhttp_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/internal/dbtest"
	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/deadletter"
	"github.com/kvmesh/kvmesh/pkg/deadletter/dlqhttp"
	"github.com/kvmesh/kvmesh/pkg/httpserver"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

const token = "dlqhttp-test-token"

// The shared routes over a scheduler-like store: admin-only reads, a page,
// one entry, a replay through the handler, and no dry run.
func TestRoutes(t *testing.T) {
	t.Parallel()
	pool := dbtest.NewPool(t)
	ctx := context.Background()
	store := deadletter.NewStore(pool, deadletter.ServiceScheduler)
	for i := range 3 {
		rec := bus.Received{Message: bus.Message{Topic: "kvmesh.engine.steps", Key: fmt.Sprint("k", i), Value: []byte(`{"i":1}`)},
			Offset: int64(i), Time: time.Unix(1, 0)}
		if err := store.Record()(ctx, rec, kvcore.ReasonInvalidRecord, errors.New("no request id")); err != nil {
			t.Fatal(err)
		}
	}
	replayer := deadletter.NewHandlerReplayer(store, func(context.Context, bus.Received) error { return nil })
	srv, err := httpserver.New(httpserver.Options{Addr: "127.0.0.1:0", AdminToken: token})
	if err != nil {
		t.Fatal(err)
	}
	dlqhttp.New(store, replayer, slog.New(slog.DiscardHandler)).Mount(srv.Router(), srv.RequireAdmin(), srv.RequireAdmin())
	ts := httptest.NewServer(srv.Handler())
	t.Cleanup(ts.Close)

	if code := testenv.CallJSON(t, http.MethodGet, ts.URL+"/v1/dlq", "", nil); code != http.StatusUnauthorized {
		t.Errorf("GET /v1/dlq without a token: %d", code)
	}
	var page dlqhttp.Page
	if code := testenv.CallJSON(t, http.MethodGet, ts.URL+"/v1/dlq?limit=2&reason=invalid_record", token, &page); code != http.StatusOK ||
		len(page.Items) != 2 || page.NextCursor == "" || page.Items[0].Key != "k2" || page.Items[0].Payload != nil || page.Items[0].PayloadBytes != 7 {
		t.Fatalf("first page: %d %+v", code, page)
	}
	var e deadletter.Entry
	id := page.Items[0].ID
	if code := testenv.CallJSON(t, http.MethodGet, fmt.Sprintf("%s/v1/dlq/%d", ts.URL, id), token, &e); code != http.StatusOK ||
		string(e.PayloadJSON) != `{"i":1}` || e.Detail != "no request id" {
		t.Fatalf("GET one: %d %+v", code, e)
	}
	var prob httpserver.Problem
	if code := testenv.CallJSON(t, http.MethodPost, fmt.Sprintf("%s/v1/dlq/%d/replay?dry_run=true", ts.URL, id), token, &prob); code != http.StatusBadRequest ||
		prob.Extras["parameter"] != "dry_run" {
		t.Errorf("dry run without one: %d %+v", code, prob)
	}
	var a deadletter.ReplayAnswer
	if code := testenv.CallJSON(t, http.MethodPost, fmt.Sprintf("%s/v1/dlq/%d/replay", ts.URL, id), token, &a); code != http.StatusOK ||
		a.ReplayStatus != deadletter.ReplayDone || a.AlreadyReplayed || a.ReplayCount != 1 {
		t.Errorf("replay: %d %+v", code, a)
	}
	if code := testenv.CallJSON(t, http.MethodGet, ts.URL+"/v1/dlq/999999", token, &prob); code != http.StatusNotFound {
		t.Errorf("unknown id: %d", code)
	}
}
