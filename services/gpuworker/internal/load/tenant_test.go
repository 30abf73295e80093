package load_test

import (
	"context"
	"testing"

	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
)

// TestLoadReadsTheTasksTenantOnly: the fixture stored its values under no
// tenant; a load task of tenant acme reads acme's keys only, so every
// block is a load error until acme's own keys hold the values; a task with
// a bad tenant is not planned (every block a load error), never a crash.
func TestLoadReadsTheTasksTenantOnly(t *testing.T) {
	f := newStreamFixture(t, 2, 4)
	ctx := context.Background()
	task := *f.task
	task.Tenant = "acme"
	if res := f.loader.Load(ctx, &task); len(res.LoadErrors) != 12 {
		t.Fatalf("tenant acme loaded another tenant's blocks: load errors %v, want all 12", res.LoadErrors)
	}
	values, _, err := f.store.Get(ctx, f.keys)
	if err != nil {
		t.Fatal(err)
	}
	for i, k := range f.keys {
		p, err := kvcore.ParseKey(k)
		if err != nil {
			t.Fatal(err)
		}
		p.Tenant = "acme"
		if p.Key() == k {
			t.Fatalf("tenant key %q equals the untenanted key", k)
		}
		if _, err := f.store.Put(ctx, []kvstore.Item{{Key: p.Key(), Value: values[i]}}); err != nil {
			t.Fatal(err)
		}
	}
	if res := f.loader.Load(ctx, &task); len(res.LoadErrors) != 0 {
		t.Fatalf("tenant acme's own keys: load errors %v, want none", res.LoadErrors)
	}
	task.Tenant = "not a tenant"
	if res := f.loader.Load(ctx, &task); len(res.LoadErrors) != 12 {
		t.Fatalf("bad tenant: load errors %v, want all 12", res.LoadErrors)
	}
}
