package dbtest_test

import (
	"sync"
	"testing"

	"github.com/kvmesh/kvmesh/internal/dbtest"
)

func TestNewPoolGivesMigratedPrivateDatabases(t *testing.T) {
	var mu sync.Mutex
	seen := map[string]bool{}
	for _, name := range []string{"first", "second", "third"} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			pool := dbtest.NewPool(t)
			var db string
			var outbox bool
			err := pool.QueryRow(t.Context(),
				"SELECT current_database(), to_regclass('outbox') IS NOT NULL").Scan(&db, &outbox)
			if err != nil {
				t.Fatalf("query: %v", err)
			}
			if !outbox {
				t.Error("outbox table missing: migrations not applied")
			}
			mu.Lock()
			defer mu.Unlock()
			if seen[db] {
				t.Errorf("database %s handed out twice", db)
			}
			seen[db] = true
		})
	}
}

func TestNewDatabaseIsDroppedAtCleanup(t *testing.T) {
	var name string
	t.Run("inner", func(t *testing.T) {
		pool := dbtest.NewPool(t)
		if err := pool.QueryRow(t.Context(), "SELECT current_database()").Scan(&name); err != nil {
			t.Fatalf("query: %v", err)
		}
	})
	admin := dbtest.NewPool(t) // any connection to the server will do
	var exists bool
	err := admin.QueryRow(t.Context(),
		"SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)", name).Scan(&exists)
	if err != nil {
		t.Fatalf("query pg_database: %v", err)
	}
	if name == "" || exists {
		t.Errorf("database %q still exists after its test ended", name)
	}
}
