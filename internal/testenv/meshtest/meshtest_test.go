package meshtest_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"
	"go.uber.org/goleak"

	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/internal/testenv/meshtest"
)

func TestMain(m *testing.M) {
	code := m.Run()
	if err := testenv.RemoveBinaries(); err != nil {
		fmt.Fprintln(os.Stderr, "remove test binaries:", err)
	}
	os.Exit(code)
}

// TestMeshRunsAServiceAndCleansUp starts a mesh and the scheduler in a
// subtest: the scheduler is ready on the mesh's broker and migrates the
// mesh's database; once the subtest ends the process is gone, the keys
// under the mesh's prefix are deleted and no goroutine is left behind.
func TestMeshRunsAServiceAndCleansUp(t *testing.T) {
	before := goleak.IgnoreCurrent()
	o, err := redis.ParseURL(testenv.RedisURL(t))
	if err != nil {
		t.Fatal(err)
	}
	rdb := redis.NewClient(o)
	t.Cleanup(func() { _ = rdb.Close() })
	var (
		p      *testenv.Process
		prefix string
	)
	t.Run("mesh", func(t *testing.T) {
		m := meshtest.New(t, "mesh", "KVMESH_MODEL=hybrid-mla-linear", "KVMESH_SHUTDOWN_TIMEOUT=3s")
		prefix = m.Prefix
		want := []string{
			"KVMESH_KAFKA_BROKERS=" + strings.Join(m.Brokers, ","), "KVMESH_DATABASE_URL=" + m.DatabaseURL,
			"KVMESH_REDIS_URL=" + m.RedisURL, "KVMESH_KEY_PREFIX=" + m.Prefix,
			"KVMESH_AUTH=required", "KVMESH_AUTH_KEY=" + m.AuthSecret, "KVMESH_ADMIN_TOKEN=" + m.AdminToken,
			"KVMESH_MODEL=hybrid-mla-linear", "KVMESH_SHUTDOWN_TIMEOUT=3s",
		}
		if !slices.Equal(m.Env, want) || !strings.HasPrefix(m.Prefix, "mesh") {
			t.Fatalf("Env %q, Prefix %q; want %q and a prefix starting with mesh", m.Env, m.Prefix, want)
		}
		if _, err := m.Add("x", "no-such-service"); err == nil {
			t.Fatal("Add of an unknown service: nil error")
		}
		var err error
		if p, err = m.Start("scheduler", "scheduler", "KVMESH_MIGRATE=true"); err != nil {
			t.Fatal(err)
		}
		checkMigrated(t, m.DatabaseURL)
		if err := rdb.Set(t.Context(), prefix+"@block", "v", 0).Err(); err != nil {
			t.Fatal(err)
		}
	})
	if p == nil {
		t.Fatal("the mesh subtest did not get as far as the checks below need")
	}
	if err := p.Alive(); !errors.Is(err, testenv.ErrExited) {
		t.Errorf("scheduler after its test ended: %v, want ErrExited", err)
	}
	if n, err := rdb.Exists(context.Background(), prefix+"@block").Result(); err != nil || n != 0 {
		t.Errorf("the mesh's key is still there after its test (%d, %v)", n, err)
	}
	goleak.VerifyNone(t, before)
}

// TestStartGPUWorkers starts a gpuworker for each of two engines: each is
// ready, serves its own engine id and is found by its name.
func TestStartGPUWorkers(t *testing.T) {
	m := meshtest.New(t, "workers", "KVMESH_MODEL=hybrid-mla-linear", "KVMESH_SHUTDOWN_TIMEOUT=3s", "KVMESH_POOL_BLOCKS=16")
	if _, err := m.Start("scheduler", "scheduler", "KVMESH_MIGRATE=true"); err != nil {
		t.Fatal(err) // the gpuworkers register in the database it migrates
	}
	ids := []string{"decode-0", "decode-1"}
	procs, err := m.StartGPUWorkers(ids)
	if err != nil {
		t.Fatal(err)
	}
	if len(procs) != len(ids) {
		t.Fatalf("%d processes for %d engines", len(procs), len(ids))
	}
	for i, p := range procs {
		if m.Procs.Process(meshtest.GPUWorkerName(ids[i])) != p {
			t.Fatalf("the gpuworker of %s is not named %s", ids[i], meshtest.GPUWorkerName(ids[i]))
		}
		var pool struct {
			EngineID string `json:"engine_id"`
		}
		req, err := http.NewRequest(http.MethodGet, p.URL()+"/v1/pool", nil)
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Authorization", "Bearer "+m.EngineToken(t, ids[i])) // its own engine's token
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		err = json.NewDecoder(resp.Body).Decode(&pool)
		resp.Body.Close()
		if err != nil || pool.EngineID != ids[i] {
			t.Fatalf("gpuworker %d serves engine %q (%v), want %s", i, pool.EngineID, err, ids[i])
		}
	}
	if _, err := m.StartGPUWorkers([]string{"decode-0"}); err == nil {
		t.Fatal("a second gpuworker under the same name started")
	}
}

// checkMigrated fails the test unless the database has the workers table.
func checkMigrated(t *testing.T, url string) {
	t.Helper()
	conn, err := pgx.Connect(t.Context(), url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	var table *string
	if err := conn.QueryRow(t.Context(), "SELECT to_regclass('workers')::text").Scan(&table); err != nil || table == nil {
		t.Fatalf("the mesh's database has no workers table after the scheduler's migration (%v)", err)
	}
}
