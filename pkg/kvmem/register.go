package kvmem

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"
)

// PathKVMemory is the gpuworker route an engine registers its KV memory at
// (POST) and that shows the registered memory (GET).
const PathKVMemory = "/v1/kv-memory"

// Registration is the body of POST /v1/kv-memory: the engine's KV memory.
type Registration struct {
	// Kind is KindShm (a segment file both processes map) or KindCUDA
	// (device tensors opened by CUDA IPC, records in the segment at Path).
	Kind string `json:"kind"`
	// Path is the segment file, absolute.
	Path string `json:"path"`
	// Layout is the memory's layout; the segment's header must hold the
	// same.
	Layout Layout `json:"layout"`
	// Handles (KindCUDA only) are per group, per region the CUDA IPC handle
	// of the region's tensor.
	Handles [][]CUDAHandle `json:"handles,omitempty"`
}

// CUDAHandle is one region tensor's CUDA IPC memory handle
// (cudaIpcMemHandle_t's 64 bytes, from cudaIpcGetMemHandle in the engine)
// with the device it lives on.
type CUDAHandle struct {
	// Device is the CUDA device ordinal of the tensor.
	Device int `json:"device"`
	// Handle is the cudaIpcMemHandle_t, 64 bytes.
	Handle []byte `json:"handle"`
	// Offset is where the region tensor starts, in bytes from the base of
	// the allocation the handle names (PyTorch's caching allocator hands
	// out tensors inside larger cudaMalloc blocks, and a K/V cache's V plane
	// lies after its K plane). Non-negative; absent: 0.
	Offset int64 `json:"offset,omitempty"`
}

// Registered is the answer of GET and POST /v1/kv-memory: the pool's
// memory now.
type Registered struct {
	// Kind is KindHeap (the worker's own memory: no engine registered one),
	// KindShm or KindCUDA.
	Kind string `json:"kind"`
	// Path is the registered segment; empty for the heap.
	Path string `json:"path,omitempty"`
	// Layout is the memory's layout.
	Layout Layout `json:"layout"`
	// RegisteredAt is when the engine registered it; absent for the heap.
	RegisteredAt *time.Time `json:"registered_at,omitempty"`
	// Replaced is the kind of the memory this registration replaced (POST
	// only): what its blocks held is gone.
	Replaced string `json:"replaced,omitempty"`
}

// ErrNoRoute reports a gpuworker without the kv-memory route (an older
// worker, or a stand-in): the engine then writes over the data plane.
var ErrNoRoute = fmt.Errorf("the gpuworker has no %s route", PathKVMemory)

// Register posts reg to the gpuworker at base (http://host:port).
func Register(ctx context.Context, hc *http.Client, base string, reg Registration) (Registered, error) {
	body, err := json.Marshal(reg)
	if err != nil {
		return Registered{}, fmt.Errorf("encode registration: %w", err)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, strings.TrimRight(base, "/")+PathKVMemory, bytes.NewReader(body))
	if err != nil {
		return Registered{}, fmt.Errorf("register kv memory: %w", err)
	}
	req.Header.Set("Content-Type", "application/json")
	return do(hc, req)
}

// Current asks the gpuworker at base which memory its pool uses.
func Current(ctx context.Context, hc *http.Client, base string) (Registered, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, strings.TrimRight(base, "/")+PathKVMemory, nil)
	if err != nil {
		return Registered{}, fmt.Errorf("get kv memory: %w", err)
	}
	return do(hc, req)
}

// do sends req and decodes a Registered answer.
func do(hc *http.Client, req *http.Request) (Registered, error) {
	var out Registered
	resp, err := hc.Do(req)
	if err != nil {
		return out, fmt.Errorf("%s %s: %w", req.Method, req.URL.Path, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	switch {
	case err != nil:
		return out, fmt.Errorf("%s %s: %w", req.Method, req.URL.Path, err)
	case resp.StatusCode == http.StatusNotFound || resp.StatusCode == http.StatusMethodNotAllowed:
		return out, ErrNoRoute
	case resp.StatusCode != http.StatusOK:
		return out, fmt.Errorf("%s %s: %s: %s", req.Method, req.URL.Path, resp.Status, bytes.TrimSpace(b))
	}
	if err := json.Unmarshal(b, &out); err != nil {
		return out, fmt.Errorf("%s %s: decode answer: %w", req.Method, req.URL.Path, err)
	}
	return out, nil
}
