package database

import (
	"context"
	"errors"
	"maps"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvmesh/kvmesh/pkg/bus"
)

// tracerName is the instrumentation scope of the database spans.
const tracerName = "github.com/kvmesh/kvmesh/pkg/database"

// maxQueryText bounds the SQL text carried on a span. Queries are static,
// parameterised SQL, so the text never carries values.
const maxQueryText = 1024

// queryTracer makes one client span per query, batch and COPY of a pool
// built by Connect. It traces only calls made with a context that already
// carries a span: a request's database work joins that request's trace,
// while background polls (readiness checks, the relay's idle polls, the
// heartbeat) start no traces of their own.
type queryTracer struct{}

var (
	_ pgx.QueryTracer    = queryTracer{}
	_ pgx.BatchTracer    = queryTracer{}
	_ pgx.CopyFromTracer = queryTracer{}
)

// start begins a span named for the call when ctx carries a span.
func (queryTracer) start(ctx context.Context, name string, attrs ...attribute.KeyValue) context.Context {
	if !trace.SpanContextFromContext(ctx).IsValid() {
		return ctx
	}
	attrs = append(attrs, attribute.String("db.system.name", "postgresql"))
	ctx, _ = otel.Tracer(tracerName).Start(ctx, name, trace.WithSpanKind(trace.SpanKindClient),
		trace.WithAttributes(attrs...))
	return ctx
}

// end finishes the span start began, recording err and the rows affected.
func (queryTracer) end(ctx context.Context, rows int64, err error) {
	span := trace.SpanFromContext(ctx)
	if !span.IsRecording() {
		return
	}
	if rows >= 0 {
		span.SetAttributes(attribute.Int64("db.response.rows", rows))
	}
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		span.RecordError(err)
		span.SetStatus(codes.Error, "query failed")
	}
	span.End()
}

// TraceQueryStart implements pgx.QueryTracer.
func (t queryTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	op := operation(data.SQL)
	return t.start(ctx, "postgres "+op, attribute.String("db.operation.name", op),
		attribute.String("db.query.text", queryText(data.SQL)))
}

// TraceQueryEnd implements pgx.QueryTracer.
func (t queryTracer) TraceQueryEnd(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryEndData) {
	t.end(ctx, data.CommandTag.RowsAffected(), data.Err)
}

// TraceBatchStart implements pgx.BatchTracer.
func (t queryTracer) TraceBatchStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceBatchStartData) context.Context {
	return t.start(ctx, "postgres batch", attribute.String("db.operation.name", "batch"),
		attribute.Int("db.operation.batch.size", data.Batch.Len()))
}

// TraceBatchQuery implements pgx.BatchTracer: each statement of the batch is
// an event on the batch's span.
func (queryTracer) TraceBatchQuery(ctx context.Context, _ *pgx.Conn, data pgx.TraceBatchQueryData) {
	span := trace.SpanFromContext(ctx)
	if !span.IsRecording() {
		return
	}
	attrs := []attribute.KeyValue{attribute.String("db.query.text", queryText(data.SQL)),
		attribute.Int64("db.response.rows", data.CommandTag.RowsAffected())}
	if data.Err != nil {
		attrs = append(attrs, attribute.String("error", data.Err.Error()))
		span.SetStatus(codes.Error, "batch statement failed")
	}
	span.AddEvent("statement", trace.WithAttributes(attrs...))
}

// TraceBatchEnd implements pgx.BatchTracer.
func (t queryTracer) TraceBatchEnd(ctx context.Context, _ *pgx.Conn, data pgx.TraceBatchEndData) {
	t.end(ctx, -1, data.Err)
}

// TraceCopyFromStart implements pgx.CopyFromTracer.
func (t queryTracer) TraceCopyFromStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceCopyFromStartData) context.Context {
	return t.start(ctx, "postgres COPY", attribute.String("db.operation.name", "COPY"),
		attribute.String("db.collection.name", data.TableName.Sanitize()))
}

// TraceCopyFromEnd implements pgx.CopyFromTracer.
func (t queryTracer) TraceCopyFromEnd(ctx context.Context, _ *pgx.Conn, data pgx.TraceCopyFromEndData) {
	t.end(ctx, data.CommandTag.RowsAffected(), data.Err)
}

// operation is the first keyword of sql, upper-cased ("SELECT", "INSERT",
// "WITH"), or "query" when sql has none.
func operation(sql string) string {
	for line := range strings.Lines(sql) {
		if f := strings.Fields(line); len(f) > 0 && !strings.HasPrefix(f[0], "--") {
			return strings.ToUpper(strings.TrimRight(f[0], "(;"))
		}
	}
	return "query"
}

// queryText collapses sql's whitespace and bounds its length.
func queryText(sql string) string {
	s := strings.Join(strings.Fields(sql), " ")
	if len(s) > maxQueryText {
		s = s[:maxQueryText]
	}
	return s
}

// startPublishSpans starts one producer span per claimed outbox row, a child
// of the trace context stored with the row (the transaction that enqueued
// it), and returns the rows' messages carrying their span's context: the
// consumer of each message continues the trace of the request that caused
// it, however the relay batched it. Rows enqueued without a trace get no
// span (a nil entry in the returned spans, which are indexed like rows).
func startPublishSpans(ctx context.Context, rows []claimedRow) ([]bus.Message, []trace.Span) {
	tracer := otel.Tracer(tracerName)
	msgs := make([]bus.Message, len(rows))
	spans := make([]trace.Span, len(rows))
	for i, row := range rows {
		m := row.msg
		parent := bus.ExtractContext(ctx, m.Headers)
		if !trace.SpanContextFromContext(parent).IsValid() {
			msgs[i] = m
			continue
		}
		pctx, span := tracer.Start(parent, "outbox publish "+m.Topic, trace.WithSpanKind(trace.SpanKindProducer),
			trace.WithAttributes(
				attribute.String("messaging.destination.name", m.Topic),
				attribute.String("messaging.kafka.message.key", m.Key),
				attribute.Int64("kvmesh.outbox.id", row.id),
				attribute.Int64("kvmesh.outbox.wait_ms", time.Since(row.created).Milliseconds()),
				attribute.Int("kvmesh.outbox.batch_size", len(rows)),
			))
		headers := make(map[string]string, len(m.Headers))
		maps.Copy(headers, m.Headers)
		bus.InjectHeaders(pctx, headers)
		m.Headers = headers
		msgs[i] = m
		spans[i] = span
	}
	return msgs, spans
}

// endPublishSpans ends the relay's spans, each with its row's outcome.
func endPublishSpans(spans []trace.Span, outcomes []outcome) {
	for i, span := range spans {
		if span == nil {
			continue
		}
		switch o := outcomes[i]; {
		case o.held:
			span.SetAttributes(attribute.Bool("kvmesh.outbox.held", true))
		case o.err != nil:
			span.RecordError(o.err)
			span.SetAttributes(attribute.String("kvmesh.outbox.fail_reason", string(o.reason)))
			span.SetStatus(codes.Error, "publish failed")
		}
		span.End()
	}
}
