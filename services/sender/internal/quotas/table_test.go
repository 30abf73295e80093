package quotas

import (
	"context"
	"errors"
	"testing"

	"github.com/kvmesh/kvmesh/internal/dbtest"
	"github.com/kvmesh/kvmesh/pkg/adminapi"
)

func TestValidate(t *testing.T) {
	for _, tc := range []struct {
		name string
		q    Quota
		ok   bool
	}{
		{"bytes", Quota{Tenant: "acme", MaxBytes: 1}, true},
		{"keys, skip", Quota{Tenant: "acme", MaxKeys: 1, OnFull: adminapi.QuotaSkip}, true},
		{"no tenant", Quota{MaxBytes: 1}, false},
		{"bad tenant", Quota{Tenant: "a b", MaxBytes: 1}, false},
		{"no bound", Quota{Tenant: "acme"}, false},
		{"negative", Quota{Tenant: "acme", MaxBytes: 5, MaxKeys: -1}, false},
		{"bad on_full", Quota{Tenant: "acme", MaxBytes: 5, OnFull: "drop"}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := Validate(tc.q)
			if (err == nil) != tc.ok || (err != nil && !errors.Is(err, ErrInvalid)) {
				t.Fatalf("Validate(%+v) = %v, want ok %v (ErrInvalid otherwise)", tc.q, err, tc.ok)
			}
		})
	}
}

// TestTable: on a fresh schema, Set writes a quota (on_full evict by
// default) and replaces it, List returns every quota by tenant, Delete
// removes one and a second Delete is ErrNotFound; an invalid quota is
// refused before the database.
func TestTable(t *testing.T) {
	tb := NewTable(dbtest.NewPool(t))
	ctx := context.Background()
	a, err := tb.Set(ctx, Quota{Tenant: "b-team", MaxBytes: 1 << 30})
	if err != nil || a.OnFull != adminapi.QuotaEvict || a.UpdatedAt.IsZero() {
		t.Fatalf("Set = %+v, %v", a, err)
	}
	if _, err := tb.Set(ctx, Quota{Tenant: "a-team", MaxKeys: 10, OnFull: adminapi.QuotaSkip}); err != nil {
		t.Fatal(err)
	}
	if _, err := tb.Set(ctx, Quota{Tenant: "b-team", MaxKeys: 7}); err != nil { // replaces: no byte bound now
		t.Fatal(err)
	}
	list, err := tb.List(ctx)
	if err != nil || len(list) != 2 || list[0].Tenant != "a-team" || list[0].OnFull != adminapi.QuotaSkip ||
		list[1].Tenant != "b-team" || list[1].MaxBytes != 0 || list[1].MaxKeys != 7 {
		t.Fatalf("List = %+v, %v", list, err)
	}
	if err := tb.Delete(ctx, "a-team"); err != nil {
		t.Fatal(err)
	}
	if err := tb.Delete(ctx, "a-team"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("second Delete = %v, want ErrNotFound", err)
	}
	if _, err := tb.Set(ctx, Quota{Tenant: "c", OnFull: "drop", MaxKeys: 1}); !errors.Is(err, ErrInvalid) {
		t.Fatalf("Set of an invalid quota = %v, want ErrInvalid", err)
	}
}
