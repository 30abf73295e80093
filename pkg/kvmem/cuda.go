//go:build cuda

package kvmem

// The device path: the engine's KV tensors stay in its GPU memory; the
// gpuworker opens them by CUDA IPC (cudaIpcOpenMemHandle) and moves a
// block's regions through a host staging buffer with cudaMemcpy. The
// identity records stay in host memory, in the segment both processes
// map, so the record protocol is the same as for a shared segment.
//
// Untested: no machine with a GPU was available when this was written. It
// compiles against the CUDA runtime API (cuda_runtime_api.h, -lcudart).

/*
#cgo LDFLAGS: -lcudart
#include <string.h>
#include <cuda_runtime_api.h>

static int kvmem_open(int device, const void *handle, void **ptr) {
	cudaIpcMemHandle_t h;
	memcpy(&h, handle, sizeof(h));
	cudaError_t err = cudaSetDevice(device);
	if (err != cudaSuccess) return (int)err;
	return (int)cudaIpcOpenMemHandle(ptr, h, cudaIpcMemLazyEnablePeerAccess);
}

static int kvmem_close(void *ptr) { return (int)cudaIpcCloseMemHandle(ptr); }

static int kvmem_d2h(int device, void *dst, void *base, size_t off, size_t n) {
	cudaError_t err = cudaSetDevice(device);
	if (err != cudaSuccess) return (int)err;
	return (int)cudaMemcpy(dst, (char *)base + off, n, cudaMemcpyDeviceToHost);
}

static int kvmem_h2d(int device, void *base, size_t off, const void *src, size_t n) {
	cudaError_t err = cudaSetDevice(device);
	if (err != cudaSuccess) return (int)err;
	return (int)cudaMemcpy((char *)base + off, src, n, cudaMemcpyHostToDevice);
}

static const char *kvmem_error(int err) { return cudaGetErrorString((cudaError_t)err); }
*/
import "C"

import (
	"errors"
	"fmt"
	"unsafe"
)

// cudaHandleSize is sizeof(cudaIpcMemHandle_t).
const cudaHandleSize = 64

// errCUDA reports a failed CUDA runtime call.
var errCUDA = errors.New("cuda runtime call failed")

// cudaMemory is the engine's device tensors, opened by CUDA IPC, with
// their records in a shared segment.
type cudaMemory struct {
	seg    *Segment
	base   [][]unsafe.Pointer // base[g][r]: group g's region-r tensor on its device
	opened []unsafe.Pointer   // every mapping opened, once per distinct handle
	dev    [][]int
}

// cudaErr wraps a CUDA error code.
func cudaErr(what string, code C.int) error {
	return fmt.Errorf("%s: %s (%d): %w", what, C.GoString(C.kvmem_error(code)), int(code), errCUDA)
}

// OpenCUDA opens the engine's device tensors, one handle per group and
// region of seg's layout; seg holds their identity records. On success the
// memory owns seg.
func OpenCUDA(seg *Segment, handles [][]CUDAHandle) (Memory, error) {
	l := seg.Layout()
	m := &cudaMemory{seg: seg, base: make([][]unsafe.Pointer, len(l.Groups)), dev: make([][]int, len(l.Groups))}
	// Regions of one allocation (a K/V cache's two planes, tensors the
	// caching allocator put in one block) share a handle; CUDA maps a
	// handle once per context, so each distinct one is opened once.
	byHandle := map[string]unsafe.Pointer{}
	for g, gl := range l.Groups {
		if len(handles[g]) != len(gl.Regions) {
			_ = m.closeHandles()
			return nil, fmt.Errorf("group %d: %d handles for %d regions: %w", g, len(handles[g]), len(gl.Regions), ErrLayout)
		}
		for r, h := range handles[g] {
			if len(h.Handle) != cudaHandleSize {
				_ = m.closeHandles()
				return nil, fmt.Errorf("group %d region %d: a %d-byte handle, want %d: %w", g, r, len(h.Handle), cudaHandleSize, ErrLayout)
			}
			if h.Offset < 0 {
				_ = m.closeHandles()
				return nil, fmt.Errorf("group %d region %d: offset %d: %w", g, r, h.Offset, ErrLayout)
			}
			key := fmt.Sprintf("%d/%x", h.Device, h.Handle)
			ptr, ok := byHandle[key]
			if !ok {
				if code := C.kvmem_open(C.int(h.Device), unsafe.Pointer(&h.Handle[0]), &ptr); code != 0 {
					_ = m.closeHandles()
					return nil, cudaErr(fmt.Sprintf("open group %d region %d on device %d", g, r, h.Device), code)
				}
				byHandle[key] = ptr
				m.opened = append(m.opened, ptr)
			}
			m.base[g] = append(m.base[g], unsafe.Add(ptr, h.Offset))
			m.dev[g] = append(m.dev[g], h.Device)
		}
	}
	return m, nil
}

// Kind is KindCUDA.
func (*cudaMemory) Kind() string { return KindCUDA }

// Layout is the memory's layout.
func (m *cudaMemory) Layout() Layout { return m.seg.Layout() }

// Record is the block's record, in the shared segment.
func (m *cudaMemory) Record(group, block int) Record { return m.seg.Record(group, block) }

// Regions is nil: device memory is not host addressable.
func (*cudaMemory) Regions(int, int) [][]byte { return nil }

// CopyOut copies the block's regions from the device into dst.
func (m *cudaMemory) CopyOut(group, block int, dst [][]byte) error {
	regions := m.seg.Layout().Groups[group].Regions
	if err := m.shape(regions, dst); err != nil {
		return err
	}
	for r, size := range regions {
		off := C.size_t(int64(block) * size)
		if code := C.kvmem_d2h(C.int(m.dev[group][r]), unsafe.Pointer(&dst[r][0]), m.base[group][r], off, C.size_t(size)); code != 0 {
			return cudaErr(fmt.Sprintf("copy group %d block %d region %d to the host", group, block, r), code)
		}
	}
	return nil
}

// CopyIn copies src into the block's regions on the device.
func (m *cudaMemory) CopyIn(group, block int, src [][]byte) error {
	regions := m.seg.Layout().Groups[group].Regions
	if err := m.shape(regions, src); err != nil {
		return err
	}
	for r, size := range regions {
		off := C.size_t(int64(block) * size)
		if code := C.kvmem_h2d(C.int(m.dev[group][r]), m.base[group][r], off, unsafe.Pointer(&src[r][0]), C.size_t(size)); code != 0 {
			return cudaErr(fmt.Sprintf("copy group %d block %d region %d to the device", group, block, r), code)
		}
	}
	return nil
}

// shape checks that bufs has one buffer of each region's size.
func (*cudaMemory) shape(regions []int64, bufs [][]byte) error {
	if len(bufs) != len(regions) {
		return fmt.Errorf("%d buffers for %d regions: %w", len(bufs), len(regions), ErrRange)
	}
	for r, size := range regions {
		if int64(len(bufs[r])) != size {
			return fmt.Errorf("region %d: %d bytes for %d: %w", r, len(bufs[r]), size, ErrRange)
		}
	}
	return nil
}

// Close closes the IPC handles and unmaps the segment.
func (m *cudaMemory) Close() error {
	return errors.Join(m.closeHandles(), m.seg.Close())
}

// closeHandles closes every handle opened so far.
func (m *cudaMemory) closeHandles() error {
	var errs []error
	for i, ptr := range m.opened {
		if code := C.kvmem_close(ptr); code != 0 {
			errs = append(errs, cudaErr(fmt.Sprintf("close mapping %d", i), code))
		}
	}
	m.opened = nil
	for g := range m.base {
		m.base[g] = nil
	}
	return errors.Join(errs...)
}
