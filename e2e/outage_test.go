package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/kvmesh/kvmesh/internal/testenv"
)

// outageWithin bounds how long a service may take to notice an outage (its
// /readyz turning 503) or its end (200 again).
const outageWithin = 30 * time.Second

// TestBackendOutagesMidRun takes the store pool (a private redis-server),
// the test's PostgreSQL database and the Kafka broker away in turn in the
// middle of a 1P1D run — the first two until the services' /readyz reports
// them, the broker for two seconds — and brings each back: the run
// completes with every request ok, no wrong byte loaded or stored and the
// ledger balanced. During the store's outage the lookup stays ready with
// the store listed as degraded (it fails open and answers 0, as vLLM's
// store child does) while the sender is not ready. Saves that fell in an
// outage are dead-lettered with a reason or stored after retries, never
// lost; the store's restart loses its values (no persistence), which later
// loads report as load errors and the engine recomputes.
func TestBackendOutagesMidRun(t *testing.T) {
	store := testenv.StartRedis(t)
	s := newStack(t, stackOptions{model: model, connectors: "pd,store", poolBlocks: 64,
		env: []string{"KVMESH_REDIS_URL=" + store.URL()}, durableBroker: true})
	s.redisURL = store.URL()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cfg := simConfig(t, s, true, smallWorkload(72, 2))
	progress, done := startRun(ctx, cfg)

	waitProgress(t, progress, done, 10)
	store.Stop()
	waitDegraded(t, s.url("lookup"), "store", true) // the lookup fails open: ready, the store degraded
	waitReadyz(t, s.url("sender"), http.StatusServiceUnavailable)
	t.Log("store down: lookup degraded, sender not ready")
	store = testenv.RestartRedis(t, store) // the same address, empty
	waitDegraded(t, s.url("lookup"), "store", false)
	waitReadyz(t, s.url("sender"), http.StatusOK)
	t.Log("store back")

	waitProgress(t, progress, done, 30)
	db := s.mesh.DatabaseURL
	setConnections(t, db, false)
	waitReadyz(t, s.url("scheduler"), http.StatusServiceUnavailable)
	t.Log("database down: scheduler not ready")
	setConnections(t, db, true)
	waitReadyz(t, s.url("scheduler"), http.StatusOK)
	t.Log("database back")

	waitProgress(t, progress, done, 50)
	s.mesh.StopBroker()
	t.Log("broker down")
	outage := time.NewTimer(2 * time.Second) // the outage's length, not a synchronisation
	select {
	case <-outage.C:
	case r := <-done:
		t.Fatalf("the run ended while the broker was down: %v", r.err)
	}
	if err := s.mesh.StartBroker(); err != nil {
		t.Fatal(err)
	}
	t.Log("broker back")

	r := <-done
	if r.err != nil {
		t.Fatal(r.err)
	}
	requireOK(t, r.rep)
	for _, name := range []string{"lookup", "scheduler", "sender", "gpuworker", "gpuworker-prefill"} {
		if err := s.alive(name); err != nil {
			t.Fatal(err)
		}
	}
}

// setConnections takes the test's database away (allow false: new
// connections refused, every open one terminated) or gives it back, through
// a connection to the server's maintenance database.
func setConnections(t *testing.T, dbURL string, allow bool) {
	t.Helper()
	u, err := url.Parse(dbURL)
	if err != nil {
		t.Fatal(err)
	}
	name := strings.TrimPrefix(u.Path, "/")
	u.Path = "/postgres"
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := pgx.Connect(ctx, u.String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close(ctx)
	if _, err := c.Exec(ctx, fmt.Sprintf("ALTER DATABASE %s ALLOW_CONNECTIONS %t", pgx.Identifier{name}.Sanitize(), allow)); err != nil {
		t.Fatal(err)
	}
	if allow {
		return
	}
	if _, err := c.Exec(ctx, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()", name); err != nil {
		t.Fatal(err)
	}
}

// waitReadyz polls a service's /readyz until it answers want.
// waitDegraded polls base's /readyz until it answers 200 with check listed
// in its degraded member (degraded) or 200 without it (!degraded), failing
// the test after outageWithin.
func waitDegraded(t *testing.T, base, check string, degraded bool) {
	t.Helper()
	hc := &http.Client{Timeout: 2 * time.Second}
	var last string
	ok := poll(context.Background(), outageWithin, func() bool {
		resp, err := hc.Get(base + "/readyz")
		if err != nil {
			last = err.Error()
			return false
		}
		defer resp.Body.Close()
		var body struct {
			Degraded []string `json:"degraded"`
		}
		err = json.NewDecoder(resp.Body).Decode(&body)
		last = fmt.Sprintf("%d, degraded %v (%v)", resp.StatusCode, body.Degraded, err)
		return err == nil && resp.StatusCode == http.StatusOK && slices.Contains(body.Degraded, check) == degraded
	})
	if !ok {
		t.Fatalf("%s/readyz: %s after %v, want 200 with %q degraded: %v", base, last, outageWithin, check, degraded)
	}
}

func waitReadyz(t *testing.T, base string, want int) {
	t.Helper()
	hc := &http.Client{Timeout: 2 * time.Second}
	var got int
	var err error
	ok := poll(context.Background(), outageWithin, func() bool {
		var resp *http.Response
		if resp, err = hc.Get(base + "/readyz"); err != nil {
			got = 0
			return false
		}
		got = resp.StatusCode
		_ = resp.Body.Close()
		return got == want
	})
	if !ok {
		t.Fatalf("%s/readyz: %d (%v) after %v, want %d", base, got, err, outageWithin, want)
	}
}
