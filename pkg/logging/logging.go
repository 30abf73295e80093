// Package logging builds the structured JSON loggers of kvmesh services.
//
// Every record carries the service name, and a record logged with a context
// that holds an OpenTelemetry span (logger.InfoContext(ctx, …)) also carries
// that span's trace_id and span_id, so a log line can be found from a trace
// and the other way round.
package logging

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strings"

	"go.opentelemetry.io/otel/trace"
)

// ErrLevel means a log level name could not be parsed.
var ErrLevel = errors.New("logging: unknown level")

// Attribute keys added by this package.
const (
	KeyService = "service"
	KeyTraceID = "trace_id"
	KeySpanID  = "span_id"
)

// New returns a logger writing JSON lines to w at the given level (debug,
// info, warn or error, case-insensitive; empty means info), with a service
// attribute on every record and trace ids from the record's context.
func New(w io.Writer, level, service string) (*slog.Logger, error) {
	lvl, err := ParseLevel(level)
	if err != nil {
		return nil, err
	}
	h := slog.NewJSONHandler(w, &slog.HandlerOptions{Level: lvl})
	return slog.New(NewTraceHandler(h)).With(KeyService, service), nil
}

// ParseLevel parses a level name: debug, info, warn (or warning) or error,
// case-insensitive, optionally with an offset such as info+2. Empty means
// info.
func ParseLevel(s string) (slog.Level, error) {
	s = strings.TrimSpace(s)
	if s == "" {
		return slog.LevelInfo, nil
	}
	if strings.EqualFold(s, "warning") {
		return slog.LevelWarn, nil
	}
	var lvl slog.Level
	if err := lvl.UnmarshalText([]byte(s)); err != nil {
		return 0, fmt.Errorf("%w %q (want debug, info, warn or error)", ErrLevel, s)
	}
	return lvl, nil
}

// TraceHandler wraps a slog.Handler and adds trace_id and span_id, at the top
// level of the record, when the record's context holds a valid span context.
type TraceHandler struct {
	// base is the wrapped handler before any WithGroup; ops replays the
	// WithAttrs/WithGroup calls made since, so that trace ids can be added
	// outside any open group.
	base   slog.Handler
	ops    []func(slog.Handler) slog.Handler
	inner  slog.Handler
	groups bool
}

// NewTraceHandler wraps h.
func NewTraceHandler(h slog.Handler) *TraceHandler {
	return &TraceHandler{base: h, inner: h}
}

// Enabled reports whether the wrapped handler handles records at level.
func (h *TraceHandler) Enabled(ctx context.Context, level slog.Level) bool {
	return h.inner.Enabled(ctx, level)
}

// Handle adds the trace ids from ctx, if any, and passes the record on.
func (h *TraceHandler) Handle(ctx context.Context, r slog.Record) error {
	sc := trace.SpanContextFromContext(ctx)
	if !sc.IsValid() {
		return h.inner.Handle(ctx, r)
	}
	ids := []slog.Attr{
		slog.String(KeyTraceID, sc.TraceID().String()),
		slog.String(KeySpanID, sc.SpanID().String()),
	}
	if !h.groups {
		r = r.Clone()
		r.AddAttrs(ids...)
		return h.inner.Handle(ctx, r)
	}
	inner := h.base.WithAttrs(ids)
	for _, op := range h.ops {
		inner = op(inner)
	}
	return inner.Handle(ctx, r)
}

// WithAttrs returns a handler whose records carry attrs.
func (h *TraceHandler) WithAttrs(attrs []slog.Attr) slog.Handler {
	return h.with(func(in slog.Handler) slog.Handler { return in.WithAttrs(attrs) }, false)
}

// WithGroup returns a handler that nests later attributes under name.
func (h *TraceHandler) WithGroup(name string) slog.Handler {
	if name == "" {
		return h
	}
	return h.with(func(in slog.Handler) slog.Handler { return in.WithGroup(name) }, true)
}

func (h *TraceHandler) with(op func(slog.Handler) slog.Handler, group bool) *TraceHandler {
	ops := make([]func(slog.Handler) slog.Handler, len(h.ops), len(h.ops)+1)
	copy(ops, h.ops)
	return &TraceHandler{
		base:   h.base,
		ops:    append(ops, op),
		inner:  op(h.inner),
		groups: h.groups || group,
	}
}
