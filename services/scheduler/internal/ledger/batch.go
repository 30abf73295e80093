package ledger

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/database"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/services/scheduler/requeststate"
)

// ErrPartsCorrupt reports stored segments that disagree with their row's
// parts meta.
var ErrPartsCorrupt = errors.New("ledger: tracker parts do not match their row")

// Change is one request's part of a Unit: the request it changes (of the
// unit's engine) and how.
type Change struct {
	// RequestID names the request.
	RequestID string
	// Create lets the change start a request that has no row yet.
	Create bool
	// Event is the change: the ledger applies it to the locked request
	// with requeststate.Request.Apply.
	Event requeststate.Event
	// Emit turns what Event did into the messages to enqueue (nil: none).
	Emit EmitFunc
	// Apply, set instead of Event, changes the locked request itself and
	// returns the messages to enqueue (tests and one-off repairs).
	Apply ApplyFunc
}

// EmitFunc turns the outcome of a change's event on its request into the
// messages to enqueue. An error rolls the transaction back.
type EmitFunc func(req *requeststate.Request, out requeststate.Outcome) ([]bus.Message, error)

// Unit is one consumed record: its id, recorded in processed_records, and
// the requests it changes, in order. An engine step record is one unit
// with a change per request event; a decision or a result has one change.
type Unit struct {
	// Record identifies the record (Create is ignored; see Change).
	Record Record
	// Changes are applied in order.
	Changes []Change
}

// Statements of ApplyBatch. Arrays are passed whole (unnest), so each
// statement costs one execution whatever the number of records; segment
// contents travel as comma-joined text (hex hashes and block ids contain
// no comma) because SQL arrays of arrays must be rectangular.
const (
	insertProcessedSet = `INSERT INTO processed_records (kind, engine_id, request_id, id)
		SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[])
		ON CONFLICT DO NOTHING RETURNING kind, engine_id, request_id, id`
	// lockTrackers locks the rows and reads them, except the tracker,
	// extras and parts of a row still at the version ($3, its xmin) the
	// caller holds decoded (-1: none held): those come back NULL.
	lockTrackers = `SELECT t.engine_id, t.request_id,
		    CASE WHEN t.xmin::text::bigint = k.x THEN NULL ELSE t.tracker END,
		    CASE WHEN t.xmin::text::bigint = k.x THEN NULL ELSE t.extras END,
		    t.last_seq,
		    CASE WHEN t.xmin::text::bigint = k.x THEN NULL ELSE t.parts END,
		    t.created_at, t.xmin::text::bigint
		FROM trackers t JOIN unnest($1::text[], $2::text[], $3::bigint[]) AS k(e, r, x) ON t.engine_id = k.e AND t.request_id = k.r
		ORDER BY t.engine_id, t.request_id FOR UPDATE OF t`
	insertTrackers = `INSERT INTO trackers (engine_id, request_id, model, state, tracker, extras, parts)
		SELECT e, r, $3, $4, $5::jsonb, $6::jsonb, $7::jsonb FROM unnest($1::text[], $2::text[]) AS k(e, r)
		ORDER BY e, r ON CONFLICT DO NOTHING`
	selectHashes = `SELECT h.engine_id, h.request_id, h.start, h.hashes
		FROM tracker_hashes h JOIN unnest($1::text[], $2::text[]) AS k(e, r) ON h.engine_id = k.e AND h.request_id = k.r
		ORDER BY h.engine_id, h.request_id, h.start`
	selectBlocks = `SELECT b.engine_id, b.request_id, b.slot, b.grp, b.start, b.blocks
		FROM tracker_blocks b JOIN unnest($1::text[], $2::text[], $3::int[], $4::int[]) AS k(e, r, g0, g1)
		  ON b.engine_id = k.e AND b.request_id = k.r AND b.gen = CASE b.slot WHEN 0 THEN k.g0 ELSE k.g1 END
		ORDER BY b.engine_id, b.request_id, b.slot, b.grp, b.start`
	updateTrackers = updateTrackersSet + `)
		     AS u(engine_id, request_id, model, state, tracker, extras, last_seq, error, parts, done, load_deadline)
		WHERE t.engine_id = u.engine_id AND t.request_id = u.request_id
		RETURNING t.engine_id, t.request_id, t.xmin::text::bigint`
	// updateTrackersAt is updateTrackers of the rows still at the
	// versions ($12, their xmin) the changes were computed from; it skips
	// a row another transaction wrote since (rechecked on the row's
	// latest version when it waited for that transaction's lock).
	updateTrackersAt = updateTrackersSet + `, $12::bigint[])
		     AS u(engine_id, request_id, model, state, tracker, extras, last_seq, error, parts, done, load_deadline, xmin)
		WHERE t.engine_id = u.engine_id AND t.request_id = u.request_id AND t.xmin::text::bigint = u.xmin
		RETURNING t.engine_id, t.request_id, t.xmin::text::bigint`
	updateTrackersSet = `UPDATE trackers t SET model = u.model, state = u.state, tracker = u.tracker::jsonb,
		    extras = u.extras::jsonb, last_seq = u.last_seq, error = NULLIF(u.error, ''), parts = u.parts::jsonb,
		    updated_at = now(), finished_at = CASE WHEN u.done THEN coalesce(t.finished_at, now()) ELSE NULL END,
		    load_deadline = u.load_deadline
		FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::bigint[],
		            $8::text[], $9::text[], $10::bool[], $11::timestamptz[]`
	selectTokens = `SELECT t.engine_id, t.request_id, t.tokens
		FROM tracker_tokens t JOIN unnest($1::text[], $2::text[]) AS k(e, r) ON t.engine_id = k.e AND t.request_id = k.r`
	upsertTokens = `INSERT INTO tracker_tokens (engine_id, request_id, tokens)
		SELECT * FROM unnest($1::text[], $2::text[], $3::bytea[])
		ON CONFLICT (engine_id, request_id) DO UPDATE SET tokens = excluded.tokens`
	deleteHashes = `DELETE FROM tracker_hashes h USING unnest($1::text[], $2::text[]) AS k(e, r)
		WHERE h.engine_id = k.e AND h.request_id = k.r`
	insertHashes = `INSERT INTO tracker_hashes (engine_id, request_id, start, hashes)
		SELECT e, r, s, string_to_array(h, ',') FROM unnest($1::text[], $2::text[], $3::int[], $4::text[]) AS k(e, r, s, h)`
	deleteOldBlocks = `DELETE FROM tracker_blocks b USING unnest($1::text[], $2::text[], $3::int[], $4::int[]) AS k(e, r, s, g)
		WHERE b.engine_id = k.e AND b.request_id = k.r AND b.slot = k.s AND b.gen < k.g`
	insertBlocks = `INSERT INTO tracker_blocks (engine_id, request_id, slot, gen, grp, start, blocks)
		SELECT e, r, s, g, p, st, string_to_array(b, ',')::bigint[]
		FROM unnest($1::text[], $2::text[], $3::int[], $4::int[], $5::int[], $6::int[], $7::text[]) AS k(e, r, s, g, p, st, b)`
)

// loaded is one locked request of a batch.
type loaded struct {
	key   Key
	req   *requeststate.Request
	born  int64
	old   *parts // what the segments hold (empty for a legacy row)
	dirty bool
	next  *parts // after a store
	// xmin is the row version the transaction leaves (its xmin: the
	// transaction's id once stored, else the version locked).
	xmin int64
}

// batchTx is the state of one ApplyBatch transaction.
type batchTx struct {
	l *Ledger
	// conn runs the transaction, which the batch's first round trip
	// begins (its BEGIN pipelined with the batch's first statements) and
	// its last one commits (COMMIT pipelined after its writes).
	conn *pgx.Conn
	// begun says BEGIN was sent; ended that the transaction is over.
	begun, ended bool
	// rollbackFirst says an earlier try left its transaction open: the
	// first round trip rolls it back before its BEGIN.
	rollbackFirst bool
	reqs          map[Key]*loaded
	misses        []*loaded
	// held are the decoded requests taken from the cache for the rows
	// being locked, with the version each was decoded at.
	held map[Key]*cachedParts
	// deadline is the deadline the batch gives the load waits it stores.
	deadline time.Time
	// out are the outbox rows the transaction enqueued for publish on
	// commit (nil without a Direct, or when they are copied).
	out *database.DirectRows
}

// ApplyBatch applies units in one transaction: it records their ids (a
// unit whose id was applied before, or that repeats an earlier unit of the
// batch, is a Duplicate and changes nothing), locks every request they
// change in key order (creating the rows their changes may create), runs
// the changes in unit order, writes back only what changed — each
// request's small state in one set-based UPDATE, and the hash and block
// segments it added — and enqueues the changes' messages in the outbox, in
// order. Statuses answer units by index. An error rolls everything back.
//
// When the ledger holds every request the batch changes, decoded at its
// row's version, it applies the batch optimistically instead: it locks
// nothing before the writes, and each row's UPDATE applies only to the
// version the request was read at. Should a row have moved on (another
// replica or an operator wrote it) or a unit prove a duplicate, the
// transaction is rolled back before it commits, and the batch applied
// again as above, from the rows. Its changes may then run twice; only the
// last run's are stored and enqueued.
func (l *Ledger) ApplyBatch(ctx context.Context, units []Unit) ([]Status, error) {
	statuses := make([]Status, len(units))
	fresh := l.dedupe(units, statuses)
	if len(fresh) == 0 {
		return statuses, nil
	}
	pc, err := l.pool.Acquire(ctx)
	if err != nil {
		return nil, fmt.Errorf("ledger: acquire: %w", err)
	}
	// A connection released inside a transaction (a failed ROLLBACK) is
	// closed, never reused.
	defer pc.Release()
	b := l.newBatchTx(pc.Conn())
	defer func() { b.rollback() }() // no-op once committed
	keys, creatable := batchKeys(units, fresh)
	if b.takeAll(keys) {
		ok, err := b.optimistic(ctx, units, fresh, statuses)
		if err != nil {
			return nil, err
		}
		if ok {
			b.cacheAll()
			return statuses, nil
		}
		// A row moved on, or a unit is a duplicate: the requests taken
		// were changed for nothing (the cache keeps their parts, which
		// are checked against the rows), and the transaction, left open,
		// is rolled back.
		if b, err = b.retry(ctx); err != nil {
			return nil, err
		}
	}
	applied, err := b.lock(ctx, units, fresh, keys, creatable)
	if err != nil {
		return nil, err
	}
	if err := b.loadParts(ctx); err != nil {
		return nil, err
	}
	b.deadline = l.stampTime()
	var msgs []bus.Message
	for _, i := range fresh {
		if !applied[i] {
			statuses[i] = Duplicate
			continue
		}
		st, out, err := b.apply(units[i])
		if err != nil {
			return nil, err
		}
		statuses[i] = st
		msgs = append(msgs, out...)
	}
	if err := b.write(ctx, l.folded(msgs)); err != nil {
		return nil, err
	}
	b.cacheAll()
	return statuses, nil
}

func (l *Ledger) newBatchTx(conn *pgx.Conn) *batchTx {
	return &batchTx{l: l, conn: conn, reqs: map[Key]*loaded{}, held: map[Key]*cachedParts{}}
}

// retry returns the state of a second try of the batch on the same
// connection, which rolls b's transaction back first: with the next round
// trip's first statement, or, when a statement failed in it, at once (an
// aborted transaction refuses to prepare the next round trip's statements
// when the connection has not prepared them yet).
func (b *batchTx) retry(ctx context.Context) (*batchTx, error) {
	nb := b.l.newBatchTx(b.conn)
	if !b.begun || b.ended {
		return nb, nil
	}
	b.ended = true
	if b.conn.PgConn().TxStatus() != 'E' {
		nb.rollbackFirst = true
		return nb, nil
	}
	if _, err := b.conn.Exec(ctx, "ROLLBACK"); err != nil {
		b.ended = false // released inside the transaction: closed
		return b, fmt.Errorf("ledger: roll back: %w", err)
	}
	return nb, nil
}

// cacheAll puts the requests of the committed transaction in the cache.
func (b *batchTx) cacheAll() {
	for _, r := range b.reqs {
		p := r.old
		if r.next != nil {
			p = r.next
		}
		b.l.cache.put(r.key, r.born, p, r.xmin, r.req)
	}
}

// batchKeys returns the requests the fresh units change, and whether a
// change may create each.
func batchKeys(units []Unit, fresh []int) (keys, creatable map[Key]bool) {
	keys, creatable = map[Key]bool{}, map[Key]bool{}
	for _, i := range fresh {
		for _, c := range units[i].Changes {
			k := Key{EngineID: units[i].Record.EngineID, RequestID: c.RequestID}
			keys[k] = true
			creatable[k] = creatable[k] || c.Create
		}
	}
	return keys, creatable
}

// queueProcessed queues the insert of the fresh units' ids; scanProcessed
// reads which were new.
func queueProcessed(batch *pgx.Batch, units []Unit, fresh []int) {
	kinds, engines, requests, ids := make([]string, len(fresh)), make([]string, len(fresh)), make([]string, len(fresh)), make([]string, len(fresh))
	for j, i := range fresh {
		r := units[i].Record
		kinds[j], engines[j], requests[j], ids[j] = r.Kind, r.EngineID, r.RequestID, r.ID
	}
	batch.Queue(insertProcessedSet, kinds, engines, requests, ids)
}

// optimistic applies the batch to the requests taken from the cache, which
// hold every request it changes, without reading or locking their rows:
// one round trip begins the transaction, records the units' ids and writes
// every change, each tracker's UPDATE guarded by the row version its
// request was read at, and a second one commits — only when every id was
// new and every row was still at that version. It reports false, with the
// transaction left open for the caller to roll back, when one was not (or
// the writes met a concurrent writer in a deadlock or a serialization
// failure).
func (b *batchTx) optimistic(ctx context.Context, units []Unit, fresh []int, statuses []Status) (bool, error) {
	for k, e := range b.held {
		r := &loaded{key: k, req: e.req, born: e.born, old: e.parts, xmin: e.xmin}
		e.parts.install(r.req)
		b.reqs[k] = r
	}
	b.deadline = b.l.stampTime()
	var msgs []bus.Message
	for _, i := range fresh {
		st, out, err := b.apply(units[i])
		if err != nil {
			return false, err
		}
		statuses[i] = st
		msgs = append(msgs, out...)
	}
	msgs = b.l.folded(msgs)
	batch := &pgx.Batch{}
	b.begin(batch)
	queueProcessed(batch, units, fresh)
	rows, large, err := b.queueWrites(ctx, batch, msgs, true)
	if err != nil {
		return false, err
	}
	br := b.conn.SendBatch(ctx, batch)
	err = b.scanBegin(br)
	var newIDs map[Record]bool
	if err == nil {
		newIDs, err = scanProcessed(br)
	}
	stored := 0
	if err == nil {
		stored, err = b.scanStored(br, rows)
	}
	stale := err == nil && (len(newIDs) != len(fresh) || stored != rows)
	if cerr := br.Close(); err == nil && cerr != nil {
		err = cerr
	}
	if stale || conflict(err) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("ledger: store %d requests: %w", rows, err)
	}
	if large {
		if err := database.EnqueueCopy(ctx, b.conn, msgs); err != nil {
			return false, fmt.Errorf("ledger: %w", err)
		}
	}
	b.ended = true // whatever COMMIT answers, the transaction is over
	_, err = b.conn.Exec(ctx, "COMMIT")
	b.l.direct.Settle(b.out, err)
	if err != nil {
		return false, fmt.Errorf("ledger: commit: %w", err)
	}
	return true, nil
}

// conflict reports an error of a transaction that met a concurrent one: a
// deadlock or a serialization failure.
func conflict(err error) bool {
	pe, ok := errors.AsType[*pgconn.PgError](err)
	return ok && (pe.Code == "40P01" || pe.Code == "40001")
}

// id is the record's identity in processed_records (Create is not part
// of it).
func (r Record) id() Record {
	r.Create = false
	return r
}

// dedupe marks units repeating an earlier unit's id as duplicates and
// returns the indexes of the others.
func (l *Ledger) dedupe(units []Unit, statuses []Status) []int {
	seen := make(map[Record]bool, len(units))
	fresh := make([]int, 0, len(units))
	for i, u := range units {
		id := u.Record.id()
		if seen[id] {
			statuses[i] = Duplicate
			continue
		}
		seen[id] = true
		fresh = append(fresh, i)
	}
	return fresh
}

// lock records the fresh units' ids and locks the rows of their requests
// (keys), creating the missing rows a change may create (creatable); it
// reports which units were not applied before.
func (b *batchTx) lock(ctx context.Context, units []Unit, fresh []int, keys, creatable map[Key]bool) (map[int]bool, error) {
	batch := &pgx.Batch{}
	b.begin(batch)
	queueProcessed(batch, units, fresh)
	ke, kr := keyArrays(keys)
	batch.Queue(lockTrackers, ke, kr, b.versions(ke, kr))
	br := b.conn.SendBatch(ctx, batch)
	err := b.scanBegin(br)
	var newIDs map[Record]bool
	if err == nil {
		newIDs, err = scanProcessed(br)
	}
	if err == nil {
		err = b.scanLocked(br)
	}
	if cerr := br.Close(); err == nil && cerr != nil {
		err = fmt.Errorf("ledger: lock: %w", cerr)
	}
	if err != nil {
		return nil, err
	}
	missing := map[Key]bool{}
	for k := range keys {
		if b.reqs[k] == nil && creatable[k] {
			missing[k] = true
		}
	}
	if err := b.create(ctx, missing); err != nil {
		return nil, err
	}
	applied := make(map[int]bool, len(fresh))
	for _, i := range fresh {
		applied[i] = newIDs[units[i].Record.id()]
	}
	return applied, nil
}

// begin queues the statements that open the batch's transaction, the
// first of batch (which the caller sends next): BEGIN, after the ROLLBACK
// of an earlier try's transaction.
func (b *batchTx) begin(batch *pgx.Batch) {
	if b.rollbackFirst {
		batch.Queue("ROLLBACK")
	}
	batch.Queue("BEGIN")
	b.begun = true
}

// scanBegin reads the results of what begin queued.
func (b *batchTx) scanBegin(br pgx.BatchResults) error {
	if b.rollbackFirst {
		if _, err := br.Exec(); err != nil {
			return fmt.Errorf("ledger: roll back: %w", err)
		}
	}
	if _, err := br.Exec(); err != nil {
		return fmt.Errorf("ledger: begin: %w", err)
	}
	return nil
}

// rollback ends the transaction unless it was committed. Should the
// ROLLBACK fail, the connection, released inside the transaction, is
// closed by the pool.
func (b *batchTx) rollback() {
	if !(b.begun || b.rollbackFirst) || b.ended {
		return
	}
	b.ended = true
	database.Rollback(b.conn)
}

// commit queues the COMMIT that ends the transaction, the last statement
// of batch.
func (b *batchTx) commit(batch *pgx.Batch) {
	batch.Queue("COMMIT")
}

// takeAll takes from the cache the decoded requests of keys and reports
// whether it held every one. A taken request is this transaction's alone:
// applied and put back after the commit, or dropped with a rollback.
func (b *batchTx) takeAll(keys map[Key]bool) bool {
	for k := range keys {
		if e := b.l.cache.take(k); e != nil {
			b.held[k] = e
		}
	}
	return len(b.held) == len(keys)
}

// versions returns the versions the requests taken of the keys
// (engines[i], requests[i]) were decoded at, -1 where none was taken.
func (b *batchTx) versions(engines, requests []string) []int64 {
	xs := noVersions(len(engines))
	for i := range engines {
		if e := b.held[Key{EngineID: engines[i], RequestID: requests[i]}]; e != nil {
			xs[i] = e.xmin
		}
	}
	return xs
}

// noVersions is n versions that match no row.
func noVersions(n int) []int64 {
	xs := make([]int64, n)
	for i := range xs {
		xs[i] = -1
	}
	return xs
}

// compareKeys orders keys as the trackers' primary key does.
func compareKeys(a, b Key) int {
	if c := strings.Compare(a.EngineID, b.EngineID); c != 0 {
		return c
	}
	return strings.Compare(a.RequestID, b.RequestID)
}

// keyArrays returns the keys as two parallel arrays in key order.
func keyArrays(keys map[Key]bool) (engines, requests []string) {
	list := make([]Key, 0, len(keys))
	for k := range keys {
		list = append(list, k)
	}
	slices.SortFunc(list, compareKeys)
	engines, requests = make([]string, len(list)), make([]string, len(list))
	for i, k := range list {
		engines[i], requests[i] = k.EngineID, k.RequestID
	}
	return engines, requests
}

// scanProcessed reads the ids insertProcessedSet inserted.
func scanProcessed(br pgx.BatchResults) (map[Record]bool, error) {
	rows, err := br.Query()
	if err != nil {
		return nil, fmt.Errorf("ledger: record ids: %w", err)
	}
	out := map[Record]bool{}
	var r Record
	_, err = pgx.ForEachRow(rows, []any{&r.Kind, &r.EngineID, &r.RequestID, &r.ID}, func() error {
		out[r] = true
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("ledger: record ids: %w", err)
	}
	return out, nil
}

// scanLocked decodes the locked rows; a row whose parts are not cached is
// a miss, read by loadParts.
func (b *batchTx) scanLocked(br pgx.BatchResults) error {
	rows, err := br.Query()
	if err != nil {
		return fmt.Errorf("ledger: lock: %w", err)
	}
	var k Key
	var tb, xb, pb []byte
	var seq, xmin int64
	var created time.Time
	_, err = pgx.ForEachRow(rows, []any{&k.EngineID, &k.RequestID, &tb, &xb, &seq, &pb, &created, &xmin}, func() error {
		if tb == nil {
			return b.adoptHeld(k, seq, created, xmin)
		}
		if err := b.adopt(k, tb, xb, seq, pb, created); err != nil {
			return err
		}
		b.reqs[k].xmin = xmin
		return nil
	})
	if err != nil {
		return fmt.Errorf("ledger: lock: %w", err)
	}
	return nil
}

// adopt decodes one locked row and finds its parts in the cache.
func (b *batchTx) adopt(k Key, tb, xb []byte, seq int64, pb []byte, created time.Time) error {
	req, err := decode(tb, xb, seq)
	if err != nil {
		return err
	}
	r := &loaded{key: k, req: req, born: created.UnixMicro()}
	b.reqs[k] = r
	if pb == nil {
		// Written before migration 0006: the chain and tables are inline
		// (decoded into req) and no segment holds them yet, so the next
		// store writes them all.
		r.old = &parts{}
		return nil
	}
	var meta PartsMeta
	if err := jsonUnmarshal(pb, &meta); err != nil {
		return fmt.Errorf("ledger: parts of %s/%s: %w", k.EngineID, k.RequestID, err)
	}
	if meta.empty() { // nothing stored yet: no segment to read
		r.old = &parts{meta: meta}
		return nil
	}
	if p := b.l.cache.get(k, r.born, &meta); p != nil {
		r.old = p
		p.install(req)
		return nil
	}
	r.old = &parts{meta: meta}
	b.misses = append(b.misses, r)
	return nil
}

// adoptHeld takes the locked row of k as the cache held it: the row is at
// the version it was decoded at (lockTrackers sent no tracker).
func (b *batchTx) adoptHeld(k Key, seq int64, created time.Time, xmin int64) error {
	e := b.held[k]
	born := created.UnixMicro()
	if e == nil || e.req == nil || e.born != born || e.xmin != xmin || e.req.LastSeq != seq {
		return fmt.Errorf("ledger: %s/%s: row at version %d sent without its tracker, which is not held: %w", k.EngineID, k.RequestID, xmin, ErrPartsCorrupt)
	}
	r := &loaded{key: k, req: e.req, born: born, old: e.parts, xmin: xmin}
	e.parts.install(r.req)
	b.reqs[k] = r
	return nil
}

// create inserts the missing rows (fresh trackers) and locks them.
func (b *batchTx) create(ctx context.Context, missing map[Key]bool) error {
	if len(missing) == 0 {
		return nil
	}
	state, tb, xb, pb, err := b.l.freshRow()
	if err != nil {
		return err
	}
	ke, kr := keyArrays(missing)
	batch := &pgx.Batch{}
	batch.Queue(insertTrackers, ke, kr, b.l.model.Name, state, tb, xb, pb)
	batch.Queue(lockTrackers, ke, kr, noVersions(len(ke)))
	br := b.conn.SendBatch(ctx, batch)
	_, err = br.Exec()
	if err != nil {
		err = fmt.Errorf("ledger: create %d trackers: %w", len(missing), err)
	} else {
		err = b.scanLocked(br)
	}
	if cerr := br.Close(); err == nil && cerr != nil {
		err = fmt.Errorf("ledger: create: %w", cerr)
	}
	if err != nil {
		return err
	}
	for k := range missing {
		r := b.reqs[k]
		if r == nil {
			return fmt.Errorf("ledger: create %s/%s: row not found after insert", k.EngineID, k.RequestID)
		}
		// A fresh row's tracker JSON carries no ids; they are the key's.
		r.req.Store.EngineID, r.req.Store.RequestID = k.EngineID, k.RequestID
	}
	return nil
}

// loadParts reads the segments of the rows whose parts were not cached.
func (b *batchTx) loadParts(ctx context.Context) error {
	if len(b.misses) == 0 {
		return nil
	}
	n := len(b.misses)
	es, rs, g0, g1 := make([]string, n), make([]string, n), make([]int32, n), make([]int32, n)
	byKey := make(map[Key]*loaded, n)
	for i, r := range b.misses {
		es[i], rs[i] = r.key.EngineID, r.key.RequestID
		g0[i], g1[i] = int32(r.old.meta.Slots[slotStore].Gen), int32(r.old.meta.Slots[slotPD].Gen)
		byKey[r.key] = r
		r.old.tables = emptyTables(&r.old.meta)
	}
	batch := &pgx.Batch{}
	batch.Queue(selectHashes, es, rs)
	batch.Queue(selectBlocks, es, rs, g0, g1)
	te, tr := tokenKeys(b.misses)
	if len(te) > 0 {
		batch.Queue(selectTokens, te, tr)
	}
	br := b.conn.SendBatch(ctx, batch)
	err := scanHashes(br, byKey)
	if err == nil {
		err = scanBlocks(br, byKey)
	}
	if err == nil && len(te) > 0 {
		err = scanTokens(br, byKey)
	}
	if cerr := br.Close(); err == nil && cerr != nil {
		err = fmt.Errorf("ledger: read parts: %w", cerr)
	}
	if err != nil {
		return err
	}
	for _, r := range b.misses {
		if err := r.old.check(r.key); err != nil {
			return err
		}
		r.old.install(r.req)
	}
	return nil
}

// tokenKeys are the keys of the rows whose meta says tracker_tokens holds
// their token ids.
func tokenKeys(rows []*loaded) (engines, requests []string) {
	for _, r := range rows {
		if r.old.meta.Tokens > 0 {
			engines, requests = append(engines, r.key.EngineID), append(requests, r.key.RequestID)
		}
	}
	return engines, requests
}

func scanTokens(br pgx.BatchResults, byKey map[Key]*loaded) error {
	rows, err := br.Query()
	if err != nil {
		return fmt.Errorf("ledger: read tokens: %w", err)
	}
	var k Key
	var raw []byte
	_, err = pgx.ForEachRow(rows, []any{&k.EngineID, &k.RequestID, &raw}, func() error {
		tokens, err := unpackTokens(raw)
		if err != nil {
			return fmt.Errorf("%s/%s: %w", k.EngineID, k.RequestID, err)
		}
		byKey[k].old.tokens = tokens
		return nil
	})
	if err != nil {
		return fmt.Errorf("ledger: read tokens: %w", err)
	}
	return nil
}

// emptyTables returns the tables meta describes, with empty groups.
func emptyTables(meta *PartsMeta) [numSlots]kvcore.BlockTable {
	var out [numSlots]kvcore.BlockTable
	for s, sm := range meta.Slots {
		if sm.Lens != nil {
			out[s] = make(kvcore.BlockTable, len(sm.Lens))
		}
	}
	return out
}

func scanHashes(br pgx.BatchResults, byKey map[Key]*loaded) error {
	rows, err := br.Query()
	if err != nil {
		return fmt.Errorf("ledger: read hashes: %w", err)
	}
	var k Key
	var start int
	var hs []string
	_, err = pgx.ForEachRow(rows, []any{&k.EngineID, &k.RequestID, &start, &hs}, func() error {
		p := byKey[k].old
		if start != len(p.hashes) {
			return fmt.Errorf("%s/%s: hash segment at %d after %d hashes: %w", k.EngineID, k.RequestID, start, len(p.hashes), ErrPartsCorrupt)
		}
		p.hashes = append(p.hashes, hs...)
		return nil
	})
	if err != nil {
		return fmt.Errorf("ledger: read hashes: %w", err)
	}
	return nil
}

func scanBlocks(br pgx.BatchResults, byKey map[Key]*loaded) error {
	rows, err := br.Query()
	if err != nil {
		return fmt.Errorf("ledger: read blocks: %w", err)
	}
	var k Key
	var slot, grp, start int
	var bs []int64
	_, err = pgx.ForEachRow(rows, []any{&k.EngineID, &k.RequestID, &slot, &grp, &start, &bs}, func() error {
		p := byKey[k].old
		if slot >= numSlots || p.tables[slot] == nil || grp >= len(p.tables[slot]) || start != len(p.tables[slot][grp]) {
			return fmt.Errorf("%s/%s: block segment slot %d group %d at %d: %w", k.EngineID, k.RequestID, slot, grp, start, ErrPartsCorrupt)
		}
		for _, v := range bs {
			p.tables[slot][grp] = append(p.tables[slot][grp], kvcore.BlockID(v))
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("ledger: read blocks: %w", err)
	}
	return nil
}

// check verifies the read segments against the meta.
func (p *parts) check(k Key) error {
	if len(p.hashes) != p.meta.Hashes {
		return fmt.Errorf("%s/%s: %d hashes stored, row says %d: %w", k.EngineID, k.RequestID, len(p.hashes), p.meta.Hashes, ErrPartsCorrupt)
	}
	if len(p.tokens) != p.meta.Tokens {
		return fmt.Errorf("%s/%s: %d token ids stored, row says %d: %w", k.EngineID, k.RequestID, len(p.tokens), p.meta.Tokens, ErrPartsCorrupt)
	}
	for s, sm := range p.meta.Slots {
		for g, n := range sm.Lens {
			if len(p.tables[s][g]) != n {
				return fmt.Errorf("%s/%s: slot %d group %d holds %d blocks, row says %d: %w", k.EngineID, k.RequestID, s, g, len(p.tables[s][g]), n, ErrPartsCorrupt)
			}
		}
	}
	return nil
}

// apply runs one unit's changes on the locked requests.
func (b *batchTx) apply(u Unit) (Status, []bus.Message, error) {
	var msgs []bus.Message
	found := false
	for _, c := range u.Changes {
		r := b.reqs[Key{EngineID: u.Record.EngineID, RequestID: c.RequestID}]
		if r == nil {
			continue
		}
		found = true
		out, err := b.change(c, r.req)
		if err != nil {
			return "", nil, err
		}
		r.dirty = true
		msgs = append(msgs, out...)
	}
	if !found && len(u.Changes) > 0 {
		return NoRequest, nil, nil
	}
	return Applied, msgs, nil
}

// change applies one change to its locked request: its event through the
// state machine's one entry (requeststate.Request.Apply), then Emit; or
// its Apply function.
func (b *batchTx) change(c Change, req *requeststate.Request) ([]bus.Message, error) {
	if c.Event == nil {
		if c.Apply == nil {
			return nil, nil
		}
		return c.Apply(req)
	}
	out := req.Apply(b.l.modelFor(req, c.Event), c.Event)
	if c.Emit == nil {
		return nil, nil
	}
	return c.Emit(req, out)
}

// write stores every changed request, enqueues msgs and commits, in one
// round trip (two when msgs are large enough to be copied). A failed
// statement skips the ones after it, the COMMIT among them, and leaves the
// transaction for rollback to end.
func (b *batchTx) write(ctx context.Context, msgs []bus.Message) error {
	batch := &pgx.Batch{}
	rows, large, err := b.queueWrites(ctx, batch, msgs, false)
	if err != nil {
		return err
	}
	if !large {
		b.commit(batch)
	}
	if batch.Len() > 0 {
		br := b.conn.SendBatch(ctx, batch)
		_, err := b.scanStored(br, rows)
		if cerr := br.Close(); err == nil && cerr != nil {
			err = cerr
		}
		b.l.direct.Settle(b.out, err)
		if err != nil {
			return fmt.Errorf("ledger: store %d requests and commit: %w", rows, err)
		}
	}
	if large {
		if err := database.EnqueueCopy(ctx, b.conn, msgs); err != nil {
			return fmt.Errorf("ledger: %w", err)
		}
		if _, err := b.conn.Exec(ctx, "COMMIT"); err != nil {
			return fmt.Errorf("ledger: commit: %w", err)
		}
	}
	b.ended = true
	return nil
}

// queueWrites queues the writes of every changed request, in key order,
// and, unless they are to be copied (large), msgs' outbox rows. rows is
// the number of trackers the first statement (queued when rows > 0)
// updates. guard makes each tracker's UPDATE apply only to the row version
// its request was read at.
func (b *batchTx) queueWrites(ctx context.Context, batch *pgx.Batch, msgs []bus.Message, guard bool) (rows int, large bool, err error) {
	var w writeSet
	for _, r := range b.sorted() {
		if !r.dirty {
			continue
		}
		if err := w.add(r, b.deadline); err != nil {
			return 0, false, err
		}
	}
	w.queue(batch, guard)
	large = valueBytes(msgs) > database.CopyThreshold
	if !large {
		var err error
		if b.out, err = b.l.direct.EnqueueBatch(ctx, batch, msgs); err != nil {
			return 0, false, fmt.Errorf("ledger: %w", err)
		}
	}
	return w.rows(), large, nil
}

// sorted returns the transaction's requests in key order.
func (b *batchTx) sorted() []*loaded {
	out := make([]*loaded, 0, len(b.reqs))
	for _, r := range b.reqs {
		out = append(out, r)
	}
	slices.SortFunc(out, func(x, y *loaded) int { return compareKeys(x.key, y.key) })
	return out
}

// scanStored reads the versions updateTrackers (queued first when n > 0)
// gave the stored rows, and returns how many it stored.
func (b *batchTx) scanStored(br pgx.BatchResults, n int) (int, error) {
	if n == 0 {
		return 0, nil
	}
	rows, err := br.Query()
	if err != nil {
		return 0, err
	}
	var k Key
	var xmin int64
	stored := 0
	_, err = pgx.ForEachRow(rows, []any{&k.EngineID, &k.RequestID, &xmin}, func() error {
		if r := b.reqs[k]; r != nil {
			r.xmin = xmin
			stored++
		}
		return nil
	})
	return stored, err
}

// valueBytes sums the messages' value sizes.
func valueBytes(msgs []bus.Message) int {
	n := 0
	for _, m := range msgs {
		n += len(m.Value)
	}
	return n
}

// writeSet collects the column arrays of one batch's writes.
type writeSet struct {
	// trackers rows
	te, tr, model, state, tracker, extras, errs, partsJSON []string
	seq                                                    []int64
	// xmin are the row versions the changes were computed from
	xmin         []int64
	done         []bool
	loadDeadline []pgtype.Timestamptz
	// hash segments (and chains to delete first)
	he, hr, hh []string
	hs         []int32
	de, dr     []string
	// block segments
	be, br, bb             []string
	bslot, bgen, bgrp, bst []int32
	// older generations to delete
	oe, or    []string
	os, ogens []int32
	// token rows to write
	ke, kr []string
	kt     [][]byte
}

func (w *writeSet) rows() int { return len(w.te) }

// add records one changed request, giving its new load waits deadline.
func (w *writeSet) add(r *loaded, deadline time.Time) error {
	earliest, waits := r.req.StampLoadDeadlines(deadline)
	nw, d := diff(r.old, r.req)
	tb, xb, err := smallJSON(r.req, &nw.meta)
	if err != nil {
		return err
	}
	pb, err := jsonMarshal(nw.meta)
	if err != nil {
		return err
	}
	r.next = nw
	k, t := r.key, r.req.Store
	w.te, w.tr, w.model, w.state = append(w.te, k.EngineID), append(w.tr, k.RequestID), append(w.model, t.Model), append(w.state, string(t.State))
	w.tracker, w.extras, w.errs, w.partsJSON = append(w.tracker, string(tb)), append(w.extras, string(xb)), append(w.errs, t.Error), append(w.partsJSON, string(pb))
	w.seq, w.done, w.xmin = append(w.seq, r.req.LastSeq), append(w.done, r.req.Done()), append(w.xmin, r.xmin)
	w.loadDeadline = append(w.loadDeadline, pgtype.Timestamptz{Time: earliest, Valid: waits})
	if d.rewriteHashes {
		w.de, w.dr = append(w.de, k.EngineID), append(w.dr, k.RequestID)
	}
	for _, h := range d.hashes {
		w.he, w.hr, w.hs, w.hh = append(w.he, k.EngineID), append(w.hr, k.RequestID), append(w.hs, int32(h.start)), append(w.hh, strings.Join(h.hashes, ","))
	}
	for _, s := range d.blocks {
		w.be, w.br, w.bb = append(w.be, k.EngineID), append(w.br, k.RequestID), append(w.bb, joinIDs(s.blocks))
		w.bslot, w.bgen, w.bgrp, w.bst = append(w.bslot, int32(s.slot)), append(w.bgen, int32(s.gen)), append(w.bgrp, int32(s.grp)), append(w.bst, int32(s.start))
	}
	if d.writeTokens {
		w.ke, w.kr, w.kt = append(w.ke, k.EngineID), append(w.kr, k.RequestID), append(w.kt, packTokens(d.tokens))
	}
	for _, s := range d.newGen {
		w.oe, w.or, w.os, w.ogens = append(w.oe, k.EngineID), append(w.or, k.RequestID), append(w.os, int32(s)), append(w.ogens, int32(nw.meta.Slots[s].Gen))
	}
	return nil
}

// queue adds the set-based statements for what add collected; guard
// updates only the rows still at the versions the changes were computed
// from.
func (w *writeSet) queue(batch *pgx.Batch, guard bool) {
	switch {
	case len(w.te) > 0 && guard:
		batch.Queue(updateTrackersAt, w.te, w.tr, w.model, w.state, w.tracker, w.extras, w.seq, w.errs, w.partsJSON, w.done, w.loadDeadline, w.xmin)
	case len(w.te) > 0:
		batch.Queue(updateTrackers, w.te, w.tr, w.model, w.state, w.tracker, w.extras, w.seq, w.errs, w.partsJSON, w.done, w.loadDeadline)
	}
	if len(w.de) > 0 {
		batch.Queue(deleteHashes, w.de, w.dr)
	}
	if len(w.he) > 0 {
		batch.Queue(insertHashes, w.he, w.hr, w.hs, w.hh)
	}
	if len(w.ke) > 0 {
		batch.Queue(upsertTokens, w.ke, w.kr, w.kt)
	}
	if len(w.oe) > 0 {
		batch.Queue(deleteOldBlocks, w.oe, w.or, w.os, w.ogens)
	}
	if len(w.be) > 0 {
		batch.Queue(insertBlocks, w.be, w.br, w.bslot, w.bgen, w.bgrp, w.bst, w.bb)
	}
}

// joinIDs renders block ids as comma-separated decimal.
func joinIDs(ids []int64) string {
	buf := make([]byte, 0, len(ids)*6)
	for i, v := range ids {
		if i > 0 {
			buf = append(buf, ',')
		}
		buf = strconv.AppendInt(buf, v, 10)
	}
	return string(buf)
}
