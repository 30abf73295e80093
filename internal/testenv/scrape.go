package testenv

import (
	"io"
	"net/http"
	"time"

	"github.com/kvmesh/kvmesh/pkg/telemetry"
)

// MetricSum reads base's /metrics and sums family's series whose label is
// value (label "": every series). ok is false when the scrape failed or
// the family has no such series.
func MetricSum(base, family, label, value string) (sum float64, ok bool) {
	c := &http.Client{Timeout: 5 * time.Second}
	resp, err := c.Get(base + "/metrics")
	if err != nil {
		return 0, false
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		return 0, false
	}
	fams, err := telemetry.ParseExposition(body)
	if err != nil {
		return 0, false
	}
	v := telemetry.SumSeries(fams[family], label, value)
	if v == nil {
		return 0, false
	}
	return *v, true
}
