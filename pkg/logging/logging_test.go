package logging_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"strings"
	"testing"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/kvmesh/kvmesh/pkg/logging"
)

func TestParseLevel(t *testing.T) {
	tests := []struct {
		in      string
		want    slog.Level
		wantErr bool
	}{
		{"", slog.LevelInfo, false},
		{"debug", slog.LevelDebug, false},
		{"INFO", slog.LevelInfo, false},
		{"Warn", slog.LevelWarn, false},
		{"warning", slog.LevelWarn, false},
		{"error", slog.LevelError, false},
		{"info+2", slog.LevelInfo + 2, false},
		{"verbose", 0, true},
	}
	for _, tt := range tests {
		got, err := logging.ParseLevel(tt.in)
		if tt.wantErr {
			if !errors.Is(err, logging.ErrLevel) || !strings.Contains(err.Error(), tt.in) {
				t.Errorf("ParseLevel(%q) error = %v, want ErrLevel naming the input", tt.in, err)
			}
			continue
		}
		if err != nil || got != tt.want {
			t.Errorf("ParseLevel(%q) = %v, %v; want %v", tt.in, got, err, tt.want)
		}
	}
}

func TestNewRejectsBadLevel(t *testing.T) {
	if _, err := logging.New(&bytes.Buffer{}, "loud", "x"); !errors.Is(err, logging.ErrLevel) {
		t.Fatalf("New error = %v, want ErrLevel", err)
	}
}

// decodeLines parses JSON log lines.
func decodeLines(t *testing.T, b *bytes.Buffer) []map[string]any {
	t.Helper()
	var out []map[string]any
	for _, line := range strings.Split(strings.TrimSpace(b.String()), "\n") {
		if line == "" {
			continue
		}
		var m map[string]any
		if err := json.Unmarshal([]byte(line), &m); err != nil {
			t.Fatalf("log line %q is not JSON: %v", line, err)
		}
		out = append(out, m)
	}
	return out
}

func TestLoggerCarriesServiceAndTraceIDs(t *testing.T) {
	tp := sdktrace.NewTracerProvider()
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	ctx, span := tp.Tracer("test").Start(context.Background(), "op")
	defer span.End()
	sc := span.SpanContext()

	var buf bytes.Buffer
	logger, err := logging.New(&buf, "info", "scheduler")
	if err != nil {
		t.Fatal(err)
	}
	logger.InfoContext(ctx, "with span", "k", 1)
	logger.WithGroup("req").With("id", "r1").InfoContext(ctx, "grouped", "n", 2)
	logger.InfoContext(context.Background(), "no span")
	logger.DebugContext(ctx, "filtered out")

	lines := decodeLines(t, &buf)
	if len(lines) != 3 {
		t.Fatalf("got %d lines, want 3 (debug filtered): %s", len(lines), buf.String())
	}
	for i, l := range lines {
		if l[logging.KeyService] != "scheduler" {
			t.Errorf("line %d service = %v, want scheduler", i, l[logging.KeyService])
		}
	}
	for _, l := range lines[:2] {
		if l[logging.KeyTraceID] != sc.TraceID().String() || l[logging.KeySpanID] != sc.SpanID().String() {
			t.Errorf("line %v: want top-level trace_id %s span_id %s", l, sc.TraceID(), sc.SpanID())
		}
	}
	group, ok := lines[1]["req"].(map[string]any)
	if !ok || group["id"] != "r1" || group["n"] != float64(2) {
		t.Errorf("grouped line %v: want req.id and req.n inside the group", lines[1])
	}
	if _, has := lines[2][logging.KeyTraceID]; has {
		t.Errorf("line without span has trace_id: %v", lines[2])
	}
}
