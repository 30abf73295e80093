package sending

import (
	"sync"
	"time"

	"github.com/kvmesh/kvmesh/pkg/adminapi"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// gate is kvcore.PressureGate shared by the consumers and replays of one
// process, with the pressure-mode gauge kept in step.
type gate struct {
	mu      sync.Mutex
	g       kvcore.PressureGate
	metrics *Metrics
}

// PressureState is the pressure gate as GET /v1/stats shows it.
type PressureState = adminapi.PressureState

func (g *gate) admit(now time.Time) kvcore.Admission {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.g.Admit(now)
}

func (g *gate) onNoSpace(now time.Time) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.g.OnNoSpace(now)
	g.metrics.pressure.Set(1)
}

func (g *gate) onPutOK() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.g.OnPutOK()
	g.metrics.pressure.Set(0)
}

func (g *gate) state() kvcore.PressureGate {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.g
}
