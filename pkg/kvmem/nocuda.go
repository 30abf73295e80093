//go:build !cuda

package kvmem

import "fmt"

// OpenCUDA would open the engine's device tensors; this build has no CUDA
// and returns ErrNoCUDA.
func OpenCUDA(_ *Segment, handles [][]CUDAHandle) (Memory, error) {
	return nil, fmt.Errorf("%d groups of CUDA IPC handles: %w", len(handles), ErrNoCUDA)
}
