package telemetry

import "testing"

func TestSumSeries(t *testing.T) {
	fams, err := ParseExposition([]byte(`# TYPE kvmesh_store_bytes_total counter
kvmesh_store_bytes_total{op="save_put"} 3
kvmesh_store_bytes_total{op="load_get"} 5
# TYPE kvmesh_pool gauge
kvmesh_pool 2
# TYPE kvmesh_load_seconds histogram
kvmesh_load_seconds_bucket{le="+Inf"} 1
kvmesh_load_seconds_sum 0.5
kvmesh_load_seconds_count 1
`))
	if err != nil {
		t.Fatal(err)
	}
	value := func(p *float64) any {
		if p == nil {
			return nil
		}
		return *p
	}
	cases := []struct {
		family, label, value string
		want                 any
	}{
		{"kvmesh_store_bytes_total", "", "", 8.0},
		{"kvmesh_store_bytes_total", "op", "save_put", 3.0},
		{"kvmesh_store_bytes_total", "op", "none", nil},
		{"kvmesh_pool", "", "", 2.0},
		{"kvmesh_load_seconds", "", "", nil},
		{"absent", "", "", nil},
	}
	for _, tc := range cases {
		if got := value(SumSeries(fams[tc.family], tc.label, tc.value)); got != tc.want {
			t.Errorf("SumSeries(%s, %s=%q) = %v, want %v", tc.family, tc.label, tc.value, got, tc.want)
		}
	}
	if _, err := ParseExposition([]byte("not { a metric")); err == nil {
		t.Error("ParseExposition accepted garbage")
	}
}
