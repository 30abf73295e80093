package app_test

import (
	"context"
	"io"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxh200"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"

	"github.com/kvmesh/kvmesh/internal/servicetest"
	"github.com/kvmesh/kvmesh/services/gpuworker/internal/app"
	"github.com/kvmesh/kvmesh/services/gpuworker/internal/devices"
)

// metricsText returns the worker's /metrics page.
func metricsText(t *testing.T, w *worker) string {
	t.Helper()
	resp, err := http.Get("http://" + w.addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}

// waitMetric polls /metrics until it holds line.
func waitMetric(t *testing.T, w *worker, line string) {
	t.Helper()
	deadline := time.Now().Add(waitFor)
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for !strings.Contains(metricsText(t, w), line) {
		if time.Now().After(deadline) {
			t.Fatalf("/metrics never showed %q:\n%s", line, metricsText(t, w))
		}
		<-tick.C
	}
}

func TestDevicesWithoutNVML(t *testing.T) {
	t.Parallel()
	env := servicetest.NewEnv(t)
	missing := nvml.New(nvml.WithLibraryPath(filepath.Join(t.TempDir(), "libnvidia-ml.so.1")))
	w := startWorker(t, testConfig(env, "engine-nogpu"), devices.NewSource(missing))
	var inv devices.Inventory
	getJSON(t, "http://"+w.app.Addr()+"/v1/devices", &inv)
	if inv.Devices == nil || len(inv.Devices) != 0 || !strings.Contains(inv.Reason, "NVML unavailable") {
		t.Fatalf("inventory = %+v, want no devices and a reason", inv)
	}
	if m := metricsText(t, w); strings.Contains(m, "kvmesh_gpu_memory_used_bytes{") || !strings.Contains(m, "\nkvmesh_gpu_devices 0\n") {
		t.Fatal("without GPUs: want kvmesh_gpu_devices 0 and no per-GPU metrics")
	}
}

func TestDevicesAndPoolWithMockH200(t *testing.T) {
	t.Parallel()
	env := servicetest.NewEnv(t)
	h200 := dgxh200.New()
	for _, d := range h200.Devices {
		d.(*server.Device).GetUtilizationRatesFunc = func() (nvml.Utilization, nvml.Return) {
			return nvml.Utilization{Gpu: 25}, nvml.SUCCESS
		}
	}
	w := startWorker(t, testConfig(env, "engine-h200"), devices.NewSource(h200))
	base := "http://" + w.app.Addr()

	var inv devices.Inventory
	getJSON(t, base+"/v1/devices", &inv)
	if len(inv.Devices) != 8 || inv.Devices[7].Name != "NVIDIA H200 141GB HBM3e" || inv.Reason != "" {
		t.Fatalf("inventory = %+v, want 8 H200s", inv)
	}
	uuid := inv.Devices[0].UUID
	m := metricsText(t, w)
	for _, want := range []string{
		`kvmesh_gpu_memory_total_bytes{gpu="` + uuid + `"} 1.51397597184e+11`,
		`kvmesh_gpu_memory_used_bytes{gpu="` + uuid + `"} 0`,
		`kvmesh_gpu_utilization_ratio{gpu="` + uuid + `"} 0.25`,
		"\nkvmesh_gpu_devices 8\n",
		`kvmesh_gpuworker_pool_blocks{group="1",state="free"} 16`,
	} {
		if !strings.Contains(m, want) {
			t.Fatalf("/metrics lacks %q", want)
		}
	}

	w.fill(t, 0, 2, 3)
	var pool app.PoolAnswer
	getJSON(t, base+"/v1/pool", &pool)
	g0 := pool.Groups[0]
	if pool.EngineID != "engine-h200" || pool.Model != "hybrid-mla-linear" || len(pool.Groups) != 2 ||
		g0.Blocks != 16 || g0.BytesPerBlock != 73728 || g0.BytesTotal != 16*73728 || g0.InUse != 2 || pool.Groups[1].InUse != 0 {
		t.Fatalf("pool = %+v", pool)
	}
	waitMetric(t, w, `kvmesh_gpuworker_pool_blocks{group="0",state="in_use"} 2`)

	post := func(token string) int {
		req, _ := http.NewRequestWithContext(context.Background(), http.MethodPost, base+"/v1/pool/reset", nil)
		if token != "" {
			req.Header.Set("Authorization", "Bearer "+token)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	if code := post(""); code != http.StatusUnauthorized {
		t.Fatalf("reset without a token: %d", code)
	}
	if code := post("test-token"); code != http.StatusOK {
		t.Fatalf("reset with the token: %d", code)
	}
	getJSON(t, base+"/v1/pool", &pool)
	if pool.Groups[0].InUse != 0 {
		t.Fatalf("after reset in use = %d", pool.Groups[0].InUse)
	}
}
