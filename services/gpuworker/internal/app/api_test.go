package app_test

import (
	"encoding/json"
	"net/http"
	"slices"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxh200"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"

	"github.com/kvmesh/kvmesh/internal/servicetest"
	"github.com/kvmesh/kvmesh/pkg/httpserver"
	"github.com/kvmesh/kvmesh/services/gpuworker/internal/app"
	"github.com/kvmesh/kvmesh/services/gpuworker/internal/devices"
)

func TestDevicesPaginated(t *testing.T) {
	t.Parallel()
	h200 := dgxh200.New()
	for _, d := range h200.Devices {
		d.(*server.Device).GetUtilizationRatesFunc = func() (nvml.Utilization, nvml.Return) {
			return nvml.Utilization{Gpu: 50}, nvml.SUCCESS
		}
	}
	w := startWorker(t, testConfig(servicetest.NewEnv(t), "engine-pages"), devices.NewSource(h200))
	base := "http://" + w.app.Addr() + "/v1/devices"

	var all app.DevicesPage
	getJSON(t, base, &all)
	if len(all.Devices) != 8 || all.NextCursor != "" || all.DriverVersion == "" {
		t.Fatalf("default page: %d devices, cursor %q, driver %q; want all 8 and no cursor", len(all.Devices), all.NextCursor, all.DriverVersion)
	}
	var seen []int
	var sizes []int
	cursor := ""
	for pages := 0; ; pages++ {
		if pages > 8 {
			t.Fatal("pagination does not end")
		}
		var p app.DevicesPage
		getJSON(t, base+"?limit=3&cursor="+cursor, &p)
		if p.DriverVersion != all.DriverVersion {
			t.Fatalf("page %d lost the inventory fields: %+v", pages, p)
		}
		sizes = append(sizes, len(p.Devices))
		for _, d := range p.Devices {
			seen = append(seen, d.Index)
		}
		if p.NextCursor == "" {
			break
		}
		cursor = p.NextCursor
	}
	if !slices.Equal(sizes, []int{3, 3, 2}) || !slices.Equal(seen, []int{0, 1, 2, 3, 4, 5, 6, 7}) {
		t.Fatalf("pages of 3 gave sizes %v, indexes %v", sizes, seen)
	}

	for query, param := range map[string]string{
		"limit=0": "limit", "limit=1001": "limit", "limit=three": "limit",
		"cursor=zzz": "cursor", "cursor=" + httpserver.EncodeCursor(map[string]int{}): "cursor",
	} {
		resp, err := http.Get(base + "?" + query)
		if err != nil {
			t.Fatal(err)
		}
		var p httpserver.Problem
		err = json.NewDecoder(resp.Body).Decode(&p)
		resp.Body.Close()
		if err != nil || resp.StatusCode != http.StatusBadRequest || p.Extras["parameter"] != param {
			t.Errorf("?%s: %d %+v %v, want 400 naming %s", query, resp.StatusCode, p, err, param)
		}
	}
}
