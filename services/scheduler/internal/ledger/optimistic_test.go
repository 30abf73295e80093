package ledger_test

import (
	"context"
	"fmt"
	"reflect"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kvmesh/kvmesh/internal/dbtest"
	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/services/scheduler/internal/ledger"
	"github.com/kvmesh/kvmesh/services/scheduler/requeststate"
)

// replicaLedgers are two schedulers' ledgers of the dense model on one
// database (replicas), pa the first one's pool, and the serial
// application their changes must add up to.
func replicaLedgers(t *testing.T) (pa *pgxpool.Pool, ca, cb *wireCounter, a, b *ledger.Ledger, s *serial) {
	t.Helper()
	pa, pb, ca, cb := replicas(t)
	m, err := kvcore.Preset("dense")
	if err != nil {
		t.Fatal(err)
	}
	return pa, ca, cb, ledger.New(pa, m), ledger.New(pb, m), newSerial(t, m)
}

// replicas are two pools on one database, each counting what it sends, as
// two scheduler replicas would hold.
func replicas(t *testing.T) (a, b *pgxpool.Pool, ca, cb *wireCounter) {
	t.Helper()
	cfg := dbtest.NewPool(t).Config()
	open := func() (*pgxpool.Pool, *wireCounter) {
		c := &wireCounter{}
		cfg := cfg.Copy()
		cfg.ConnConfig.Tracer = c
		p, err := pgxpool.NewWithConfig(context.Background(), cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(p.Close)
		return p, c
	}
	a, ca = open()
	b, cb = open()
	return a, b, ca, cb
}

// serial applies one request's engine events through ledgers and, beside
// them, in order to one in-memory request: what the ledgers store must be
// what a serial application computes.
type serial struct {
	t    *testing.T
	m    *kvcore.Model
	twin *requeststate.Request
	seq  int64
}

func newSerial(t *testing.T, m *kvcore.Model) *serial {
	return &serial{t: t, m: m, twin: requeststate.New(m, "e1", "r1")}
}

// next returns the request's next event (admitted, a new step, then
// decode steps), applied to the twin.
func (s *serial) next() contract.RequestEvent {
	s.seq++
	prompt := 2048
	bs := s.m.Groups[0].BlockSize
	var ev contract.RequestEvent
	switch s.seq {
	case 1:
		ev = contract.RequestEvent{RequestID: "r1", Kind: contract.EventAdmitted, PromptTokens: prompt,
			BlockHashes: hexChain(prompt / s.m.HashBlockSize)}
	case 2:
		ev = scheduled("r1", kvcore.StepNew, prompt, kvcore.BlockTable{blocks(0, prompt/bs)}, hexChain(prompt/s.m.HashBlockSize))
	default:
		ev = scheduled("r1", kvcore.StepDecode, prompt+int(s.seq), kvcore.BlockTable{{kvcore.BlockID(prompt + int(s.seq))}}, nil)
	}
	ev.Seq = s.seq
	s.twin.Engine(s.m, s.m.Name, ev)
	return ev
}

// unit is the step record of ev, whose change notes the last seq of each
// state it ran on in seen.
func (s *serial) unit(ev contract.RequestEvent, seen *[]int64) ledger.Unit {
	return ledger.Unit{Record: ledger.Record{Kind: ledger.KindStep, ID: fmt.Sprint("step", ev.Seq), EngineID: "e1"},
		Changes: []ledger.Change{{RequestID: "r1", Create: true, Apply: func(req *requeststate.Request) ([]bus.Message, error) {
			*seen = append(*seen, req.LastSeq)
			req.Engine(s.m, s.m.Name, ev)
			return []bus.Message{{Topic: contract.TopicEngineFeedback, Key: "r1", Value: []byte(fmt.Sprint(ev.Seq))}}, nil
		}}}}
}

// apply applies the next event through l and returns what l sent and the
// last seqs its change ran on.
func (s *serial) apply(l *ledger.Ledger, c *wireCounter) (wire, []int64) {
	s.t.Helper()
	var seen []int64
	u := s.unit(s.next(), &seen)
	var st []ledger.Status
	var err error
	w := c.measure(func() { st, err = l.ApplyBatch(context.Background(), []ledger.Unit{u}) })
	if err != nil || st[0] != ledger.Applied {
		s.t.Fatalf("seq %d: %v %v", s.seq, st, err)
	}
	return w, seen
}

// check compares the stored request and outbox with the serial
// application's.
func (s *serial) check(pool *pgxpool.Pool) {
	s.t.Helper()
	row, err := ledger.New(pool, s.m).Get(context.Background(), ledger.Key{EngineID: "e1", RequestID: "r1"})
	if err != nil {
		s.t.Fatal(err)
	}
	got, _ := row.Request()
	if got.LastSeq != s.twin.LastSeq || !reflect.DeepEqual(got.Store, s.twin.Store) || !reflect.DeepEqual(got.Extras, s.twin.Extras) {
		s.t.Fatalf("stored request (last seq %d)\n%+v\n%+v\nwant (last seq %d)\n%+v\n%+v", got.LastSeq, *got.Store, got.Extras, s.twin.LastSeq, *s.twin.Store, s.twin.Extras)
	}
	rows, err := pool.Query(context.Background(), `SELECT convert_from(value, 'UTF8') FROM outbox ORDER BY id`)
	if err != nil {
		s.t.Fatal(err)
	}
	var vals []string
	for rows.Next() {
		var v string
		if err := rows.Scan(&v); err != nil {
			s.t.Fatal(err)
		}
		vals = append(vals, v)
	}
	var want []string
	for i := int64(1); i <= s.seq; i++ {
		want = append(want, fmt.Sprint(i))
	}
	if !reflect.DeepEqual(vals, want) {
		s.t.Fatalf("outbox %v, want one message per event, in order: %v", vals, want)
	}
}

// Two replicas write one request in turn (a rebalance moves its partition
// back and forth). A replica whose cached request is at the row's version
// applies without locking; one whose cache is stale finds its guarded
// UPDATE touching no row, rolls back and applies again from the row, so
// that every change runs on the request's latest state and the stored
// request is the serial application's.
func TestReplicasInterleavingOneRequest(t *testing.T) {
	pa, ca, cb, a, b, s := replicaLedgers(t)
	optimistic := func(who string, w wire, seen []int64) {
		t.Helper()
		if w.locks != 0 || w.trackerUpdates != 1 || w.roundTrips != 2 || !reflect.DeepEqual(seen, []int64{s.seq - 1}) {
			t.Fatalf("seq %d by %s: %v, changes ran on %v; want an optimistic apply on seq %d", s.seq, who, w, seen, s.seq-1)
		}
	}
	stale := func(who string, w wire, seen []int64) {
		t.Helper()
		t.Logf("seq %d by %s (stale): %v", s.seq, who, w)
		// 3 round trips; one more when a write after the UPDATE failed (a
		// segment the stale request would add is stored already), so that
		// the ROLLBACK goes alone, and one more when the row's segments
		// moved on too and are read.
		if w.locks != 1 || w.trackerUpdates != 2 || w.roundTrips < 3 || w.roundTrips > 5 || len(seen) != 2 || seen[1] != s.seq-1 {
			t.Fatalf("seq %d by %s: %v, changes ran on %v; want an optimistic try, then a locked apply on seq %d", s.seq, who, w, seen, s.seq-1)
		}
	}
	locked := func(who string, w wire, seen []int64) {
		t.Helper()
		// 2 round trips, 3 with the segments to read
		if w.locks != 1 || w.trackerUpdates != 1 || w.roundTrips > 3 || !reflect.DeepEqual(seen, []int64{s.seq - 1}) {
			t.Fatalf("seq %d by %s: %v, changes ran on %v; want a locked apply on seq %d", s.seq, who, w, seen, s.seq-1)
		}
	}
	s.apply(a, ca) // creates the row
	w, seen := s.apply(a, ca)
	optimistic("a", w, seen)
	w, seen = s.apply(b, cb) // b holds nothing
	locked("b", w, seen)
	w, seen = s.apply(a, ca) // a holds seq 2's version, the row is at seq 3's
	stale("a", w, seen)
	w, seen = s.apply(b, cb)
	stale("b", w, seen)
	w, seen = s.apply(b, cb)
	optimistic("b", w, seen)
	w, seen = s.apply(a, ca)
	stale("a", w, seen)
	s.check(pa)
}

// A replica's optimistic UPDATE that waits for another replica's lock on
// the row rechecks the row's version once that one commits, finds it moved
// on, and applies again from the row.
func TestOptimisticApplyWaitingForAnotherReplica(t *testing.T) {
	pa, ca, _, a, b, s := replicaLedgers(t)
	ctx := context.Background()
	s.apply(a, ca)
	s.apply(a, ca) // a holds the row's version
	var seenA, seenB []int64
	ub := s.unit(s.next(), &seenB) // b's event, then a's
	ua := s.unit(s.next(), &seenA)
	inner := ub.Changes[0].Apply
	locked, release := make(chan struct{}), make(chan struct{})
	ub.Changes[0].Apply = func(req *requeststate.Request) ([]bus.Message, error) {
		close(locked) // b holds nothing: this runs with the row locked
		<-release
		return inner(req)
	}
	done := make(chan error, 2)
	apply := func(l *ledger.Ledger, u ledger.Unit) error {
		st, err := l.ApplyBatch(ctx, []ledger.Unit{u})
		if err == nil && st[0] != ledger.Applied {
			err = fmt.Errorf("status %s", st[0])
		}
		return err
	}
	go func() { done <- apply(b, ub) }()
	<-locked
	var wa wire
	go func() {
		var err error
		wa = ca.measure(func() { err = apply(a, ua) })
		done <- err
	}()
	for deadline := time.Now().Add(10 * time.Second); count(t, pa, `SELECT count(*) FROM pg_stat_activity
		WHERE datname = current_database() AND wait_event_type = 'Lock'`) == 0; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("a's UPDATE never waited for b's lock")
		}
	}
	close(release)
	for range 2 {
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	}
	if !reflect.DeepEqual(seenB, []int64{2}) || !reflect.DeepEqual(seenA, []int64{2, 3}) {
		t.Fatalf("b's change ran on %v, a's on %v; want [2] and [2 3]", seenB, seenA)
	}
	if wa.locks != 1 || wa.trackerUpdates != 2 {
		t.Fatalf("a sent %v; want an optimistic try, then a locked apply", wa)
	}
	s.check(pa)
}

// A redelivered record is a duplicate whichever replica applies it,
// holding its request at the row's version or not, alone or in a batch
// with a new record, which is applied once.
func TestOptimisticApplyKeepsRedeliveriesOut(t *testing.T) {
	pa, ca, cb, a, b, s := replicaLedgers(t)
	ctx := context.Background()
	s.apply(a, ca)
	s.apply(b, cb)
	var seen []int64
	last := s.unit(s.next(), &seen)
	if st, err := a.ApplyBatch(ctx, []ledger.Unit{last}); err != nil || st[0] != ledger.Applied {
		t.Fatalf("seq 3: %v %v", st, err)
	}
	// a holds the row's version, b a stale one.
	for _, r := range []struct {
		name string
		l    *ledger.Ledger
		c    *wireCounter
	}{{"a", a, ca}, {"b", b, cb}, {"a again", a, ca}} {
		var st []ledger.Status
		var err error
		w := r.c.measure(func() { st, err = r.l.ApplyBatch(ctx, []ledger.Unit{last}) })
		if err != nil || st[0] != ledger.Duplicate {
			t.Fatalf("redelivery to %s: %v %v, want duplicate", r.name, st, err)
		}
		if w.locks != 1 || w.trackerUpdates > 1 {
			t.Fatalf("redelivery to %s sent %v; want the ids recorded and the row locked, nothing written", r.name, w)
		}
	}
	var seenNew []int64
	st, err := a.ApplyBatch(ctx, []ledger.Unit{last, s.unit(s.next(), &seenNew)})
	if err != nil || !reflect.DeepEqual(st, []ledger.Status{ledger.Duplicate, ledger.Applied}) {
		t.Fatalf("a redelivery and a new record: %v %v", st, err)
	}
	if seenNew[len(seenNew)-1] != 3 {
		t.Fatalf("the new record's change ran on %v, last on seq 3", seenNew)
	}
	s.check(pa)
}
