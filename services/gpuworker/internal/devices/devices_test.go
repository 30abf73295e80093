package devices_test

import (
	"path/filepath"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxh200"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"

	"github.com/kvmesh/kvmesh/services/gpuworker/internal/devices"
)

func TestInventoryWithoutNVML(t *testing.T) {
	// The real go-nvml library, pointed at a library that does not exist:
	// exactly what a machine without the NVIDIA driver looks like.
	lib := nvml.New(nvml.WithLibraryPath(filepath.Join(t.TempDir(), "libnvidia-ml.so.1")))
	src := devices.NewSource(lib)
	defer src.Close()
	inv := src.Inventory()
	if inv.Devices == nil || len(inv.Devices) != 0 {
		t.Fatalf("devices = %#v, want an empty non-nil list", inv.Devices)
	}
	if !strings.Contains(inv.Reason, "ERROR_LIBRARY_NOT_FOUND") {
		t.Fatalf("reason = %q, want it to name ERROR_LIBRARY_NOT_FOUND", inv.Reason)
	}
}

// newH200 is go-nvml's mock DGX H200 with utilisation readings, which the
// mock leaves unset: GPU i reports 10·i percent busy.
func newH200(t *testing.T) *server.Server {
	t.Helper()
	s := dgxh200.New()
	for i, d := range s.Devices {
		dev := d.(*server.Device)
		dev.MemoryInfo.Used = uint64(i) << 30
		busy := uint32(10 * i)
		dev.GetUtilizationRatesFunc = func() (nvml.Utilization, nvml.Return) {
			return nvml.Utilization{Gpu: busy}, nvml.SUCCESS
		}
	}
	return s
}

func TestInventoryDGXH200(t *testing.T) {
	src := devices.NewSource(newH200(t))
	defer src.Close()
	inv := src.Inventory()
	if inv.Reason != "" {
		t.Fatalf("reason = %q, want none", inv.Reason)
	}
	if inv.DriverVersion != "550.54.15" {
		t.Fatalf("driver version = %q", inv.DriverVersion)
	}
	if len(inv.Devices) != 8 {
		t.Fatalf("%d devices, want 8", len(inv.Devices))
	}
	uuids := map[string]bool{}
	for i, d := range inv.Devices {
		if d.Index != i || d.Name != "NVIDIA H200 141GB HBM3e" {
			t.Errorf("device %d: index %d name %q", i, d.Index, d.Name)
		}
		if !strings.HasPrefix(d.UUID, "GPU-") || uuids[d.UUID] {
			t.Errorf("device %d: UUID %q not a distinct GPU UUID", i, d.UUID)
		}
		uuids[d.UUID] = true
		if d.MemoryTotalBytes != 144384<<20 || d.MemoryUsedBytes != uint64(i)<<30 {
			t.Errorf("device %d: memory %d used %d", i, d.MemoryTotalBytes, d.MemoryUsedBytes)
		}
		if d.Utilization == nil || *d.Utilization != float64(i)/10 {
			t.Errorf("device %d: utilization %v, want %v", i, d.Utilization, float64(i)/10)
		}
		if len(d.Errors) != 0 {
			t.Errorf("device %d: errors %v", i, d.Errors)
		}
	}
}

func TestInventoryRecordsUnreadableProperties(t *testing.T) {
	s := newH200(t)
	dev := s.Devices[3].(*server.Device)
	dev.GetUtilizationRatesFunc = func() (nvml.Utilization, nvml.Return) {
		return nvml.Utilization{}, nvml.ERROR_NOT_SUPPORTED
	}
	inv := devices.NewSource(s).Inventory()
	d := inv.Devices[3]
	if d.Utilization != nil || len(d.Errors) != 1 || !strings.Contains(d.Errors[0], "utilization: ERROR_NOT_SUPPORTED") {
		t.Fatalf("device 3 = %+v, want no utilization and one error naming it", d)
	}
	if d.Name == "" || d.MemoryTotalBytes == 0 {
		t.Fatalf("device 3 lost its other properties: %+v", d)
	}
}

func TestCloseShutsDownOnlyAnInitialisedLibrary(t *testing.T) {
	s := newH200(t)
	var inits, shutdowns int
	s.InitFunc = func() nvml.Return { inits++; return nvml.SUCCESS }
	s.ShutdownFunc = func() nvml.Return { shutdowns++; return nvml.SUCCESS }
	unused := devices.NewSource(s)
	unused.Close()
	if inits != 0 || shutdowns != 0 {
		t.Fatalf("closing an unused source: %d inits, %d shutdowns", inits, shutdowns)
	}
	used := devices.NewSource(s)
	if n := len(used.Inventory().Devices); n != 8 {
		t.Fatalf("%d devices", n)
	}
	used.Close()
	used.Close()
	if inits != 1 || shutdowns != 1 {
		t.Fatalf("%d inits, %d shutdowns; want 1 and 1", inits, shutdowns)
	}
	if inv := used.Inventory(); len(inv.Devices) != 0 || inv.Reason == "" {
		t.Fatalf("inventory after Close = %+v", inv)
	}
}
