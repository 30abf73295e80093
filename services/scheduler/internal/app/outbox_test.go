package app_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kvmesh/kvmesh/internal/servicetest"
	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/database"
	"github.com/kvmesh/kvmesh/pkg/service"
	"github.com/kvmesh/kvmesh/services/scheduler/internal/api"
	"github.com/kvmesh/kvmesh/services/scheduler/internal/app"
)

// failedPage fetches GET /v1/outbox/failed.
func failedPage(t *testing.T, base, query string) api.FailedPage {
	t.Helper()
	status, body := testenv.Call(t, http.MethodGet, base+"/v1/outbox/failed"+query, "")
	if status != http.StatusOK {
		t.Fatalf("GET /v1/outbox/failed%s = %d %s", query, status, body)
	}
	var p api.FailedPage
	if err := json.Unmarshal(body, &p); err != nil {
		t.Fatalf("decode failed page: %v", err)
	}
	return p
}

// TestFailedOutboxRowsInAdminAPI: an unpublishable outbox row between
// publishable ones of the same key leaves the relay path: the others are
// published, the bad one is listed by GET /v1/outbox/failed with its
// reason, counted in kvmesh_outbox_publish_failures_total, and an admin can
// put it back with POST /v1/outbox/{id}/retry.
func TestFailedOutboxRowsInAdminAPI(t *testing.T) {
	env := servicetest.NewEnv(t)
	cfg := app.Config{Common: env.Common(), HTTP: service.HTTP{HTTPAddr: "127.0.0.1:0"}, Database: service.Database{DatabaseURL: env.DatabaseURL}, Consumers: 1, Migrate: true}
	cfg.LogLevel = "warn"
	a, err := app.New(context.Background(), cfg, testLogger())
	a = servicetest.StartReady(t, a, err)
	base := "http://" + a.Addr()
	pool, err := pgxpool.New(t.Context(), env.DatabaseURL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	m := func(value string) bus.Message {
		return bus.Message{Topic: contract.TopicSaveDLQ, Key: "outbox-test", Value: []byte(value)}
	}
	huge := strings.Repeat("x", 1200<<10)
	err = pgx.BeginFunc(t.Context(), pool, func(tx pgx.Tx) error {
		return database.Enqueue(t.Context(), tx, m("before"), m(huge), m("after"))
	})
	if err != nil {
		t.Fatalf("enqueue: %v", err)
	}

	var page api.FailedPage
	deadline := time.Now().Add(15 * time.Second)
	for page = failedPage(t, base, ""); len(page.Items) == 0; page = failedPage(t, base, "") {
		if time.Now().After(deadline) {
			t.Fatal("timed out waiting for the failed row in GET /v1/outbox/failed")
		}
		time.Sleep(10 * time.Millisecond) // poll interval
	}
	if len(page.Items) != 1 || page.NextCursor != "" {
		t.Fatalf("failed page = %+v, want one row and no next page", page)
	}
	f := page.Items[0]
	if f.Reason != database.ReasonMessageTooLarge || f.Key != "outbox-test" || f.ValueBytes != int64(len(huge)) {
		t.Errorf("failed row = %+v, want reason %s, key outbox-test, %d value bytes", f, database.ReasonMessageTooLarge, len(huge))
	}
	var sent int
	err = pool.QueryRow(t.Context(), `SELECT count(*) FROM outbox
		WHERE key = 'outbox-test' AND sent_at IS NOT NULL AND convert_from(value, 'UTF8') IN ('before', 'after')`).Scan(&sent)
	if err != nil || sent != 2 {
		t.Errorf("%d of the publishable rows sent (%v), want 2", sent, err)
	}
	_, metrics := testenv.Call(t, http.MethodGet, base+"/metrics", "")
	if want := `kvmesh_outbox_publish_failures_total{reason="message_too_large"} 1`; !strings.Contains(string(metrics), want) {
		t.Errorf("/metrics lacks %s", want)
	}

	retry := fmt.Sprintf("%s/v1/outbox/%d/retry", base, f.ID)
	if status, _ := testenv.Call(t, http.MethodPost, retry, ""); status != http.StatusUnauthorized {
		t.Errorf("retry without a token = %d, want 401", status)
	}
	tests := []struct {
		name string
		id   int64
		want int
	}{
		{"failed row", f.ID, http.StatusOK},
		{"pending row", f.ID, http.StatusConflict}, // still pending, or failed again: then 200
		{"unknown row", f.ID + 1000, http.StatusNotFound},
	}
	for _, tt := range tests {
		status, body := testenv.Call(t, http.MethodPost, fmt.Sprintf("%s/v1/outbox/%d/retry", base, tt.id), "test-token")
		if tt.name == "pending row" && status == http.StatusOK {
			continue // the relay had already failed it again
		}
		if status != tt.want {
			t.Errorf("%s: retry = %d %s, want %d", tt.name, status, body, tt.want)
		}
	}
	if status, body := testenv.Call(t, http.MethodGet, base+"/v1/outbox/failed?limit=0", ""); status != http.StatusBadRequest {
		t.Errorf("GET /v1/outbox/failed?limit=0 = %d %s, want 400", status, body)
	}
}
