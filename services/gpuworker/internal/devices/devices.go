// Package devices is the gpuworker's GPU inventory through NVML (go-nvml):
// name, UUID, memory and utilisation of every GPU the process can see. A
// machine without NVML (no driver, no GPU) has an empty inventory and a
// reason, which is not an error.
package devices

import (
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// Device is one GPU.
type Device struct {
	// Index is the NVML device index.
	Index int `json:"index"`
	// Name is the product name, e.g. "NVIDIA H200 141GB HBM3e".
	Name string `json:"name"`
	// UUID is the GPU's UUID.
	UUID string `json:"uuid"`
	// MemoryTotalBytes is the device memory.
	MemoryTotalBytes uint64 `json:"memory_total_bytes"`
	// MemoryUsedBytes is the device memory in use.
	MemoryUsedBytes uint64 `json:"memory_used_bytes"`
	// Utilization is the GPU's busy fraction over NVML's last sample period
	// (0..1); nil when NVML cannot tell.
	Utilization *float64 `json:"utilization"`
	// Errors lists the properties NVML could not read, with NVML's reason.
	Errors []string `json:"errors,omitempty"`
}

// Inventory is the inventory part of what GET /v1/devices answers (app.DevicesPage).
type Inventory struct {
	// Devices lists the GPUs, by index; empty (never null) without NVML.
	Devices []Device `json:"devices"`
	// DriverVersion is the NVIDIA driver version, when NVML is present.
	DriverVersion string `json:"driver_version,omitempty"`
	// Reason says why Devices is empty or incomplete.
	Reason string `json:"reason,omitempty"`
}

// Source reads the inventory from an NVML implementation. It initialises
// NVML once, on first use, and is safe for concurrent use.
type Source struct {
	lib nvml.Interface

	once    sync.Once
	initErr error
	live    atomic.Bool // NVML initialised and not shut down
	mu      sync.Mutex  // NVML handles are used one caller at a time
}

// NewSource returns a source over lib: nvml.New() for the real library, or
// a mock server (go-nvml's pkg/nvml/mock) in tests.
func NewSource(lib nvml.Interface) *Source {
	return &Source{lib: lib}
}

// NewSystemSource returns a source over the machine's NVML library.
func NewSystemSource() *Source { return NewSource(nvml.New()) }

func (s *Source) init() error {
	s.once.Do(func() {
		if ret := s.lib.Init(); ret != nvml.SUCCESS {
			s.initErr = fmt.Errorf("NVML unavailable: %s (no NVIDIA driver or GPU visible)", retString(ret))
			return
		}
		s.live.Store(true)
	})
	return s.initErr
}

// Inventory lists the GPUs. Without NVML it returns no devices and the
// reason; a device NVML cannot open is skipped and named in Reason.
func (s *Source) Inventory() Inventory {
	inv := Inventory{Devices: []Device{}}
	if err := s.init(); err != nil {
		inv.Reason = err.Error()
		return inv
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.live.Load() {
		inv.Reason = "NVML shut down"
		return inv
	}
	if v, ret := s.lib.SystemGetDriverVersion(); ret == nvml.SUCCESS {
		inv.DriverVersion = v
	}
	n, ret := s.lib.DeviceGetCount()
	if ret != nvml.SUCCESS {
		inv.Reason = "NVML device count: " + retString(ret)
		return inv
	}
	if n == 0 {
		inv.Reason = "NVML reports no devices"
	}
	for i := 0; i < n; i++ {
		dev, ret := s.lib.DeviceGetHandleByIndex(i)
		if ret != nvml.SUCCESS {
			inv.Reason = fmt.Sprintf("device %d: %s", i, retString(ret))
			continue
		}
		inv.Devices = append(inv.Devices, describe(i, dev))
	}
	return inv
}

// describe reads one device's properties, recording each that fails.
func describe(i int, dev nvml.Device) Device {
	d := Device{Index: i}
	note := func(what string, ret nvml.Return) bool {
		if ret != nvml.SUCCESS {
			d.Errors = append(d.Errors, what+": "+retString(ret))
			return false
		}
		return true
	}
	var ret nvml.Return
	d.Name, ret = dev.GetName()
	note("name", ret)
	d.UUID, ret = dev.GetUUID()
	note("uuid", ret)
	if mem, ret := dev.GetMemoryInfo(); note("memory", ret) {
		d.MemoryTotalBytes, d.MemoryUsedBytes = mem.Total, mem.Used
	}
	if u, ret := dev.GetUtilizationRates(); note("utilization", ret) {
		r := float64(u.Gpu) / 100
		d.Utilization = &r
	}
	return d
}

// Close shuts NVML down if it was initialised; later inventories are
// empty with a reason.
func (s *Source) Close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.live.Swap(false) {
		_ = s.lib.Shutdown() // nothing useful to do with a failed shutdown
	}
}

// retString names an NVML return code.
func retString(ret nvml.Return) string {
	switch ret {
	case nvml.ERROR_LIBRARY_NOT_FOUND:
		return "ERROR_LIBRARY_NOT_FOUND"
	case nvml.ERROR_DRIVER_NOT_LOADED:
		return "ERROR_DRIVER_NOT_LOADED"
	case nvml.ERROR_NO_PERMISSION:
		return "ERROR_NO_PERMISSION"
	case nvml.ERROR_NOT_SUPPORTED:
		return "ERROR_NOT_SUPPORTED"
	}
	return fmt.Sprintf("%s (%d)", ret.Error(), int32(ret))
}
