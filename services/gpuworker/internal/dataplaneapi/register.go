package dataplaneapi

import (
	"errors"
	"fmt"
	"net/http"
	"path/filepath"
	"sync"
	"time"

	"github.com/go-chi/chi/v5"

	"github.com/kvmesh/kvmesh/pkg/httpserver"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/kvmem"
	"github.com/kvmesh/kvmesh/services/gpuworker/internal/pool"
)

// registerBodyLimit bounds a registration body.
const registerBodyLimit = 1 << 20

// KVMemory serves the registration of the engine's KV memory: POST
// /v1/kv-memory maps the engine's memory and makes it the pool's, GET shows
// the pool's memory. Like the rest of the data plane it is cluster
// internal and not authenticated.
type KVMemory struct {
	pool  *pool.Pool
	model *kvcore.Model
	// mu serialises registrations and guards cur.
	mu  sync.Mutex
	cur kvmem.Registered
}

// NewKVMemory serves the registrations of p's memory for model m; until an
// engine registers, the pool's memory is its own heap memory.
func NewKVMemory(p *pool.Pool, m *kvcore.Model) *KVMemory {
	return &KVMemory{pool: p, model: m, cur: kvmem.Registered{Kind: kvmem.KindHeap, Layout: heapLayout(p, m)}}
}

// heapLayout is the layout of the pool's own heap memory.
func heapLayout(p *pool.Pool, m *kvcore.Model) kvmem.Layout {
	l := kvmem.ModelLayout(m, 1)
	for g, n := range p.Blocks() {
		l.Groups[g].Blocks = n
	}
	return l
}

// Mount adds the routes to r.
func (k *KVMemory) Mount(r chi.Router) {
	r.Get(kvmem.PathKVMemory, k.get)
	r.With(httpserver.BodyLimit(registerBodyLimit)).Post(kvmem.PathKVMemory, k.register)
}

// get answers the pool's memory.
func (k *KVMemory) get(w http.ResponseWriter, _ *http.Request) {
	k.mu.Lock()
	cur := k.cur
	k.mu.Unlock()
	_ = httpserver.WriteJSON(w, http.StatusOK, cur) // a failed answer only means the client left
}

// register validates a registration against the served model, maps the
// memory and makes it the pool's, replacing the memory before (whose
// blocks' identities are gone with it). A request that is not valid is
// answered 400; a segment that does not match it (missing, not a segment,
// another format version or layout, too small) 409; CUDA memory on a build
// without CUDA 501.
func (k *KVMemory) register(w http.ResponseWriter, r *http.Request) {
	var reg kvmem.Registration
	if err := httpserver.DecodeJSON(w, r, &reg); err != nil {
		return
	}
	if err := k.validate(reg); err != nil {
		httpserver.WriteProblem(w, r, http.StatusBadRequest, "", err.Error(), nil)
		return
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	mem, err := open(reg)
	if err != nil {
		status := http.StatusConflict
		if errors.Is(err, kvmem.ErrNoCUDA) {
			status = http.StatusNotImplemented
		}
		httpserver.WriteProblem(w, r, status, "", err.Error(), nil)
		return
	}
	if err := k.pool.Replace(mem); err != nil {
		_ = mem.Close()
		httpserver.WriteProblem(w, r, http.StatusBadRequest, "", err.Error(), nil)
		return
	}
	now := time.Now().UTC()
	replaced := k.cur.Kind
	k.cur = kvmem.Registered{Kind: reg.Kind, Path: reg.Path, Layout: reg.Layout, RegisteredAt: &now}
	ans := k.cur
	ans.Replaced = replaced
	_ = httpserver.WriteJSON(w, http.StatusOK, ans) // a failed answer only means the client left
}

// validate checks a registration without touching the segment.
func (k *KVMemory) validate(reg kvmem.Registration) error {
	switch reg.Kind {
	case kvmem.KindShm:
		if len(reg.Handles) != 0 {
			return fmt.Errorf("handles are for kind %q only: %w", kvmem.KindCUDA, kvmem.ErrLayout)
		}
	case kvmem.KindCUDA:
		if len(reg.Handles) != len(reg.Layout.Groups) {
			return fmt.Errorf("%d groups of handles for %d groups: %w", len(reg.Handles), len(reg.Layout.Groups), kvmem.ErrLayout)
		}
		for g, hs := range reg.Handles {
			if len(hs) != len(reg.Layout.Groups[g].Regions) {
				return fmt.Errorf("handles[%d]: %d handles for %d regions: %w", g, len(hs), len(reg.Layout.Groups[g].Regions), kvmem.ErrLayout)
			}
		}
	default:
		return fmt.Errorf("kind %q: want %q or %q: %w", reg.Kind, kvmem.KindShm, kvmem.KindCUDA, kvmem.ErrLayout)
	}
	if !filepath.IsAbs(reg.Path) || filepath.Clean(reg.Path) != reg.Path {
		return fmt.Errorf("path %q is not a clean absolute path: %w", reg.Path, kvmem.ErrLayout)
	}
	return reg.Layout.Check(k.model)
}

// open maps the registered memory. kvmem.Open holds a shared flock on
// the segment until the memory is closed (replaced by the next
// registration, or the process dies): the engine's liveness check
// (kvmem.Segment.Mapped), which spares it asking GET /v1/kv-memory. A CUDA
// registration's records segment holds it too. Registering the segment
// already registered is safe: shared locks never conflict, and the pool
// closes the old memory (releasing its lock) only after the new one,
// already locked, is installed, so the segment never looks unmapped.
func open(reg kvmem.Registration) (kvmem.Memory, error) {
	seg, err := kvmem.Open(reg.Path, reg.Layout)
	if err != nil {
		return nil, err
	}
	if reg.Kind == kvmem.KindShm {
		return seg, nil
	}
	mem, err := kvmem.OpenCUDA(seg, reg.Handles)
	if err != nil {
		_ = seg.Close()
		return nil, err
	}
	return mem, nil
}
