package telemetry

import (
	"bytes"
	"fmt"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// ParseExposition parses a /metrics body in the Prometheus text exposition
// format into its families by name.
func ParseExposition(body []byte) (map[string]*dto.MetricFamily, error) {
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(bytes.NewReader(body))
	if err != nil {
		return nil, fmt.Errorf("parse /metrics: %w", err)
	}
	return fams, nil
}

// SumSeries sums the counter, gauge or untyped series of fam whose label
// has value (every series when label is ""); nil when fam is absent or no
// series matches.
func SumSeries(fam *dto.MetricFamily, label, value string) *float64 {
	if fam == nil {
		return nil
	}
	var sum float64
	found := false
	for _, m := range fam.GetMetric() {
		if label != "" && LabelValue(m, label) != value {
			continue
		}
		switch {
		case m.GetCounter() != nil:
			sum += m.GetCounter().GetValue()
		case m.GetGauge() != nil:
			sum += m.GetGauge().GetValue()
		case m.GetUntyped() != nil:
			sum += m.GetUntyped().GetValue()
		default:
			continue
		}
		found = true
	}
	if !found {
		return nil
	}
	return &sum
}

// LabelValue is the value of m's label name ("" when it has none).
func LabelValue(m *dto.Metric, name string) string {
	for _, l := range m.GetLabel() {
		if l.GetName() == name {
			return l.GetValue()
		}
	}
	return ""
}
