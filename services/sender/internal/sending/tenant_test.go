package sending_test

import (
	"context"
	"strings"
	"testing"

	"github.com/kvmesh/kvmesh/internal/dbtest"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
)

// TestTenantSaveKeys: a save task's keys are built in its tenant's key
// space (the sender's builder has no tenant), its BlockStored records name
// the tenant, and the same hashes of another tenant are stored again under
// that tenant's keys instead of being found present.
func TestTenantSaveKeys(t *testing.T) {
	f := newFixture(t, dbtest.NewPool(t), kvstore.NewMemory(kvstore.MemoryOptions{}))
	a := saveTask(f.model, "r1", 0, 64, 3)
	a.Tenant = "acme"
	f.handle(t, encode(t, a))
	b := saveTask(f.model, "r1", 0, 64, 3)
	b.TaskID, b.Tenant = "task-r1-b", "globex"
	f.handle(t, encode(t, b))

	for _, task := range []*kvcore.SaveTask{a, b} {
		res, ok := f.outcome(t, task.TaskID)
		want := []contract.GroupOutcome{{Group: 0, Stored: 4}, {Group: 1, Stored: 1}}
		if !ok || res.Status != "stored" || !equalGroups(res.Groups, want) {
			t.Fatalf("tenant %s: result %+v, want every key stored (not found present)", task.Tenant, res)
		}
		for g := range f.model.Groups {
			keys := f.keysOf(t, task, g)
			exists, err := f.store.Exists(context.Background(), keys)
			if err != nil {
				t.Fatal(err)
			}
			for i, k := range keys {
				if !strings.HasPrefix(k, f.model.Name+"@fp:"+f.model.Fingerprint()+"@tenant:"+task.Tenant+"@") || !exists[i] {
					t.Fatalf("tenant %s key %q: exists %v, want a stored key of the tenant", task.Tenant, k, exists[i])
				}
			}
			untenanted, _ := kvcore.PlanSend(f.model, f.keys, &kvcore.SaveTask{Groups: task.Groups, BlockTable: task.BlockTable, BlockHashes: task.BlockHashes}, g, kvcore.Rank{})
			for _, it := range untenanted {
				if ok, _ := f.store.Exists(context.Background(), []string{it.Key}); ok[0] {
					t.Fatalf("key %q of no tenant was written", it.Key)
				}
			}
		}
	}
	events, _ := f.kvRecords(t)
	if len(events) != 4 {
		t.Fatalf("%d kv events, want one per tenant and group", len(events))
	}
	for _, ev := range events {
		if ev.Tenant != "acme" && ev.Tenant != "globex" || !strings.Contains(ev.Namespace, "@tenant:"+ev.Tenant+"@") {
			t.Fatalf("kv event of tenant %q namespace %q", ev.Tenant, ev.Namespace)
		}
		if fp := f.model.Fingerprint(); ev.Fingerprint != fp || !strings.Contains(ev.Namespace, "@fp:"+fp+"@") {
			t.Fatalf("kv event fingerprint %q namespace %q, want the model's %s", ev.Fingerprint, ev.Namespace, fp)
		}
	}
}

// TestBadTenantDeadLettered: a save task whose tenant cannot be a key
// segment is dead-lettered group by group with tenant_invalid, nothing is
// put, and a result is reported; the consumer goes on.
func TestBadTenantDeadLettered(t *testing.T) {
	f := newFixture(t, dbtest.NewPool(t), kvstore.NewMemory(kvstore.MemoryOptions{}))
	task := saveTask(f.model, "r1", 0, 64, 3)
	task.Tenant = "a@b"
	rec := f.handle(t, encode(t, task))
	res, ok := f.outcome(t, task.TaskID)
	if !ok || res.Status != string(kvcore.SaveDeadLettered) {
		t.Fatalf("result %+v, want dead_lettered", res)
	}
	for _, g := range res.Groups {
		if g.Reason != string(kvcore.ReasonTenantInvalid) {
			t.Fatalf("group %+v, want reason tenant_invalid", g)
		}
	}
	dls := f.deadLetters(t, rec.Offset)
	if len(dls) != len(f.model.Groups) {
		t.Fatalf("%d dead letters, want one per group", len(dls))
	}
	for _, d := range dls {
		if d.Reason != kvcore.ReasonTenantInvalid {
			t.Fatalf("dead letter %+v, want tenant_invalid", d)
		}
	}
	if n := len(f.worker.asked()); n != 0 {
		t.Fatalf("%d items put for a task with a bad tenant", n)
	}
	ok2 := saveTask(f.model, "r2", 0, 64, 3)
	f.handle(t, encode(t, ok2))
	if res, ok := f.outcome(t, ok2.TaskID); !ok || res.Status != "stored" {
		t.Fatalf("the next task after a bad tenant: %+v", res)
	}
}
