package database

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"

	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
)

// OutboxChannel is the LISTEN/NOTIFY channel on which committed outbox
// inserts wake relays (a trigger from migration 0001 notifies it).
const OutboxChannel = "kvmesh_outbox"

// Publisher sends messages to the bus; bus.Producer satisfies it. Publish
// returns nil only once every message is acknowledged, and must keep the
// order of messages that share a key. An error that wraps a
// kafka.WriteErrors with one entry per message (as kafka-go's Writer
// returns, and bus.Producer wraps) gives each message its own outcome; any
// other error fails every message of the call. Errors are classified by
// their kafka-go error code (see the Reason constants): message-size and
// invalid-topic errors are permanent, all others transient.
type Publisher interface {
	Publish(ctx context.Context, msgs ...bus.Message) error
}

const insertOutbox = `INSERT INTO outbox (topic, key, value, headers) VALUES ($1, $2, $3, $4)`

// Enqueue writes msgs to the outbox inside the caller's transaction tx, so
// they are published (by a Relay) if and only if tx commits, in the order
// given. The W3C trace context of ctx is injected into each message's
// headers through the global propagator (otel.GetTextMapPropagator), so the
// consumer's span continues the trace of the code that enqueued it. The
// caller's header maps are not modified.
func Enqueue(ctx context.Context, tx pgx.Tx, msgs ...bus.Message) error {
	if len(msgs) == 0 {
		return nil
	}
	batch := &pgx.Batch{}
	for i, m := range msgs {
		if m.Topic == "" {
			return fmt.Errorf("database: enqueue message %d (key %q): %w", i, m.Key, ErrEmptyTopic)
		}
		batch.Queue(insertOutbox, m.Topic, m.Key, m.Value, traceHeaders(ctx, m.Headers))
	}
	if err := tx.SendBatch(ctx, batch).Close(); err != nil {
		return fmt.Errorf("database: enqueue %d messages: %w", len(msgs), err)
	}
	return nil
}

// insertOutboxSet is the set-based INSERT of EnqueueBatch.
var insertOutboxSet = OutboxInsertSQL(1, "")

// EnqueueBatch queues on batch one set-based INSERT of msgs into the
// outbox, for a caller that sends batch inside its transaction (so the rows
// commit with it, in the order given, their ids ascending). A message whose
// headers already carry a traceparent keeps it (the caller put the trace of
// the request it concerns there); the others get the trace context of ctx.
// The caller's header maps are not modified. No messages queue nothing.
func EnqueueBatch(ctx context.Context, batch *pgx.Batch, msgs []bus.Message) error {
	if len(msgs) == 0 {
		return nil
	}
	args, err := OutboxArgs(ctx, msgs)
	if err != nil {
		return err
	}
	batch.Queue(insertOutboxSet, args...)
	return nil
}

// OutboxInsertSQL is EnqueueBatch's set-based INSERT with its four array
// parameters (OutboxArgs) numbered from $first, keeping the rows only where
// cond (SQL; "" for always) holds, for a caller that embeds the insert in a
// statement of its own, such as a data-modifying CTE that enqueues messages
// only when its other insert wrote a row.
func OutboxInsertSQL(first int, cond string) string {
	where := ""
	if cond != "" {
		where = " WHERE " + cond
	}
	return fmt.Sprintf(`INSERT INTO outbox (topic, key, value, headers)
	SELECT t, k, v, h::jsonb FROM unnest($%d::text[], $%d::text[], $%d::bytea[], $%d::text[]) WITH ORDINALITY AS m(t, k, v, h, n)%s
	ORDER BY n`, first, first+1, first+2, first+3, where)
}

// OutboxArgs returns the four array parameters (topics, keys, values,
// headers) of OutboxInsertSQL for msgs, with the headers EnqueueBatch sets.
// No messages give four empty arrays.
func OutboxArgs(ctx context.Context, msgs []bus.Message) ([]any, error) {
	args, _, err := outboxRows(ctx, msgs)
	return args, err
}

// outboxRows returns OutboxArgs' parameters and msgs as they are stored:
// with the headers EnqueueBatch sets.
func outboxRows(ctx context.Context, msgs []bus.Message) ([]any, []bus.Message, error) {
	topics, keys, headers := make([]string, len(msgs)), make([]string, len(msgs)), make([]string, len(msgs))
	values := make([][]byte, len(msgs))
	stored := make([]bus.Message, len(msgs))
	for i, m := range msgs {
		h, err := rowHeaders(ctx, i, m)
		if err != nil {
			return nil, nil, err
		}
		hb, err := json.Marshal(h)
		if err != nil {
			return nil, nil, fmt.Errorf("database: enqueue message %d headers: %w", i, err)
		}
		topics[i], keys[i], values[i], headers[i] = m.Topic, m.Key, m.Value, string(hb)
		stored[i] = m
		stored[i].Headers = h
	}
	return []any{topics, keys, values, headers}, stored, nil
}

// CopyThreshold is the size of message values above which a caller should
// enqueue with EnqueueCopy rather than EnqueueBatch: binary COPY streams
// the values instead of encoding them into one array parameter.
const CopyThreshold = 1 << 20

// Copier is what EnqueueCopy copies through: a pgx.Tx, or a *pgx.Conn
// inside a transaction its caller began.
type Copier interface {
	CopyFrom(ctx context.Context, table pgx.Identifier, columns []string, src pgx.CopyFromSource) (int64, error)
}

// EnqueueCopy writes msgs to the outbox inside tx's transaction with one
// binary COPY, in order, with the headers as EnqueueBatch sets them. The
// outbox trigger fires once for the COPY, as for one INSERT.
func EnqueueCopy(ctx context.Context, tx Copier, msgs []bus.Message) error {
	if len(msgs) == 0 {
		return nil
	}
	rows := make([][]any, len(msgs))
	for i, m := range msgs {
		h, err := rowHeaders(ctx, i, m)
		if err != nil {
			return err
		}
		rows[i] = []any{m.Topic, m.Key, m.Value, h}
	}
	if _, err := tx.CopyFrom(ctx, pgx.Identifier{"outbox"}, []string{"topic", "key", "value", "headers"}, pgx.CopyFromRows(rows)); err != nil {
		return fmt.Errorf("database: copy %d messages into the outbox: %w", len(msgs), err)
	}
	return nil
}

// rowHeaders checks message i of a set-based enqueue and returns the
// headers to store: its own when they carry a traceparent, else a copy
// with ctx's trace context.
func rowHeaders(ctx context.Context, i int, m bus.Message) (map[string]string, error) {
	if m.Topic == "" {
		return nil, fmt.Errorf("database: enqueue message %d (key %q): %w", i, m.Key, ErrEmptyTopic)
	}
	if _, ok := m.Headers[contract.HeaderTraceparent]; ok {
		return m.Headers, nil
	}
	return traceHeaders(ctx, m.Headers), nil
}

// traceHeaders returns a copy of headers with ctx's trace context added.
func traceHeaders(ctx context.Context, headers map[string]string) map[string]string {
	out := make(map[string]string, len(headers)+2)
	maps.Copy(out, headers)
	otel.GetTextMapPropagator().Inject(ctx, propagation.MapCarrier(out))
	return out
}
