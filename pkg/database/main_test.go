package database_test

import (
	"testing"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	// Services install the W3C propagator at start (pkg/telemetry); so do we.
	otel.SetTextMapPropagator(propagation.TraceContext{})
	goleak.VerifyTestMain(m)
}
