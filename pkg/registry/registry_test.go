package registry_test

import (
	"context"
	"encoding/json"
	"errors"
	"reflect"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/internal/dbtest"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/registry"
)

func TestRegistry(t *testing.T) {
	pool := dbtest.NewPool(t)
	ctx := context.Background()
	r0, r1 := kvcore.Rank{}, kvcore.Rank{TP: 1}
	devs := json.RawMessage(`{"devices":[{"uuid":"GPU-1"}]}`)
	for _, w := range []registry.Worker{
		{EngineID: "e1", Rank: r1, Addr: "http://b:8084"},
		{EngineID: "e1", Rank: r0, Addr: "http://old:8084"},
		{EngineID: "e1", Rank: r0, Addr: "http://a:8084", Devices: devs}, // re-registration replaces
		{EngineID: "e2", Rank: r0, Addr: "http://c:8084"},
	} {
		if err := registry.Register(ctx, pool, w); err != nil {
			t.Fatal(err)
		}
	}

	ws, err := registry.Find(ctx, pool, "e1", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if len(ws) != 2 || ws[0].Rank != r0 || ws[1].Rank != r1 {
		t.Fatalf("Find(e1) = %+v, want ranks tp0 then tp1", ws)
	}
	if ws[0].Addr != "http://a:8084" || ws[1].Addr != "http://b:8084" {
		t.Fatalf("addresses %q, %q", ws[0].Addr, ws[1].Addr)
	}
	var got, want any
	if err := json.Unmarshal(ws[0].Devices, &got); err != nil {
		t.Fatal(err)
	}
	_ = json.Unmarshal(devs, &want)
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("devices = %s, want %s", ws[0].Devices, devs)
	}
	if ws[0].HeartbeatAt.IsZero() {
		t.Fatal("heartbeat time not read")
	}

	// Age tp1's heartbeat: it is stale and excluded until it heartbeats again.
	if _, err := pool.Exec(ctx, `UPDATE workers SET heartbeat_at = now() - interval '1 hour' WHERE engine_id = 'e1' AND tp = 1`); err != nil {
		t.Fatal(err)
	}
	ws, err = registry.Find(ctx, pool, "e1", time.Minute)
	if err != nil || len(ws) != 1 || ws[0].Rank != r0 {
		t.Fatalf("with tp1 stale, Find = %+v, %v; want only tp0", ws, err)
	}
	if _, err := registry.FindRank(ctx, pool, "e1", r1, time.Minute); !errors.Is(err, registry.ErrNoWorker) {
		t.Fatalf("FindRank(stale tp1) error = %v, want ErrNoWorker", err)
	}
	if err := registry.Heartbeat(ctx, pool, "e1", r1); err != nil {
		t.Fatal(err)
	}
	w, err := registry.FindRank(ctx, pool, "e1", r1, time.Minute)
	if err != nil || w.Addr != "http://b:8084" {
		t.Fatalf("after a heartbeat FindRank(tp1) = %+v, %v", w, err)
	}

	if _, err := registry.Find(ctx, pool, "nobody", time.Minute); !errors.Is(err, registry.ErrNoWorker) {
		t.Fatalf("Find(unknown engine) error = %v, want ErrNoWorker", err)
	}
	if err := registry.Heartbeat(ctx, pool, "nobody", r0); !errors.Is(err, registry.ErrNoWorker) {
		t.Fatalf("Heartbeat(unregistered) error = %v, want ErrNoWorker", err)
	}

	if err := registry.Deregister(ctx, pool, "e2", r0); err != nil {
		t.Fatal(err)
	}
	if _, err := registry.Find(ctx, pool, "e2", time.Minute); !errors.Is(err, registry.ErrNoWorker) {
		t.Fatalf("after Deregister Find(e2) error = %v, want ErrNoWorker", err)
	}
	if err := registry.Deregister(ctx, pool, "e2", r0); err != nil {
		t.Fatalf("second Deregister: %v", err)
	}
}
