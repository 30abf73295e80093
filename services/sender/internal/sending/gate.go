package sending

import (
	"sync"
	"time"

	"github.com/kvmesh/kvmesh/pkg/adminapi"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/services/sender/internal/sendpolicy"
)

// gate is sendpolicy.PressureGate shared by the consumers and replays of one
// process, with the pressure-mode gauge kept in step. Pressure is scoped
// to the request whose put the store answered "no space"
// (sendpolicy.PressureScopeOf): only that request's saves are skipped.
type gate struct {
	mu      sync.Mutex
	g       sendpolicy.PressureGate
	metrics *Metrics
}

// PressureState is the pressure gate as GET /v1/stats shows it.
type PressureState = adminapi.PressureState

// admit is the gate's answer for the next save task t.
func (g *gate) admit(t *kvcore.SaveTask, now time.Time) sendpolicy.Admission {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.g.Admit(sendpolicy.PressureScopeOf(t), now)
}

// onNoSpace puts t's request under pressure.
func (g *gate) onNoSpace(t *kvcore.SaveTask, now time.Time) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.g.OnNoSpace(sendpolicy.PressureScopeOf(t), now)
	g.metrics.pressure.Set(1)
}

// onPutOK lets every request go: the store took a put.
func (g *gate) onPutOK() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.g.OnPutOK()
	g.metrics.pressure.Set(0)
}

// state is a copy of the gate that shares nothing with it.
func (g *gate) state() sendpolicy.PressureGate {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.g.Clone()
}
