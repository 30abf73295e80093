package telemetry_test

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvmesh/kvmesh/pkg/telemetry"
)

func newCounter() prometheus.Counter {
	return prometheus.NewCounter(prometheus.CounterOpts{Name: "kvmesh_test_total", Help: "test"})
}

func TestRegisterOnceReturnsTheRegisteredTwin(t *testing.T) {
	reg := prometheus.NewRegistry()
	first, err := telemetry.RegisterOnce(reg, newCounter())
	if err != nil {
		t.Fatal(err)
	}
	second, err := telemetry.RegisterOnce(reg, newCounter())
	if err != nil || second != first {
		t.Fatalf("second RegisterOnce = %v, %v; want the first collector", second, err)
	}
	clash := prometheus.NewGauge(prometheus.GaugeOpts{Name: "kvmesh_test_total", Help: "other help"})
	if _, err := telemetry.RegisterOnce(reg, clash); err == nil {
		t.Fatal("a different collector under the same name was accepted")
	}
}

func TestRegisterAllFailsOnADuplicate(t *testing.T) {
	reg := prometheus.NewRegistry()
	if err := telemetry.RegisterAll(reg, newCounter(), prometheus.NewGauge(prometheus.GaugeOpts{Name: "kvmesh_test_g", Help: "g"})); err != nil {
		t.Fatal(err)
	}
	if err := telemetry.RegisterAll(reg, newCounter()); err == nil {
		t.Fatal("RegisterAll accepted a family registered twice")
	}
}
