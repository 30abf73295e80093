package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"maps"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"

	dto "github.com/prometheus/client_model/go"

	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/httpserver"
	"github.com/kvmesh/kvmesh/pkg/telemetry"
)

func init() {
	register("status", "one table of every service's readiness and key counters", runStatus)
}

// counterSpec derives one named counter from a service's metric families.
type counterSpec struct {
	name   string
	family string
	// label and value, when set, keep only the series with that label value.
	label, value string
	// byLabel, when set, makes one counter per value of that label
	// (name.value).
	byLabel string
}

// serviceCounters are the key counters the status table shows, by service.
var serviceCounters = map[string][]counterSpec{
	"lookup": {
		{name: "requests", family: "kvmesh_lookup_requests_total"},
		{name: "hits", family: "kvmesh_lookup_requests_total", label: "result", value: "hit"},
	},
	"scheduler": {
		{name: "trackers", family: "kvmesh_scheduler_trackers", byLabel: "state"},
		{name: "outbox_backlog", family: "kvmesh_outbox_backlog"},
	},
	"sender": {
		{name: "tasks", family: "kvmesh_sender_tasks_total"},
		{name: "dead_letters", family: "kvmesh_dead_letters_total"},
		{name: "pressure", family: "kvmesh_sender_pressure_mode"},
	},
	"gpuworker": {
		{name: "pool_in_use", family: "kvmesh_gpuworker_pool_blocks", label: "state", value: "in_use"},
		{name: "pool_blocks", family: "kvmesh_gpuworker_pool_blocks"},
		{name: "loads", family: "kvmesh_gpuworker_loads_total", label: "outcome", value: "ok"},
		{name: "load_errors", family: "kvmesh_gpuworker_loads_total", label: "outcome", value: "load_errors"},
	},
}

// counter is one derived counter; Value is nil when the family is absent.
type counter struct {
	Name  string   `json:"name"`
	Value *float64 `json:"value"`
}

// serviceStatus is one row of the status table.
type serviceStatus struct {
	Service string `json:"service"`
	URL     string `json:"url"`
	Ready   bool   `json:"ready"`
	// Error says why the service is not ready (failed checks, or
	// unreachable).
	Error string `json:"error,omitempty"`
	// Degraded names the optional checks a ready service failed, with
	// their errors (the /readyz body's degraded member): the lookup whose
	// store is down answers 0 tokens rather than 503.
	Degraded string `json:"degraded,omitempty"`
	// ConsumerLag sums kvmesh_consumer_lag; nil when the service exports
	// none.
	ConsumerLag *float64  `json:"consumer_lag"`
	Counters    []counter `json:"counters"`
	// MetricsError says why /metrics could not be read.
	MetricsError string `json:"metrics_error,omitempty"`
}

func runStatus(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("status", flag.ContinueOnError)
	fs.SetOutput(stderr)
	o := addClientFlags(fs)
	if rest, err := parseFlags(fs, args); err != nil || len(rest) > 0 {
		return usageOr(err, "status takes no arguments: %q", rest)
	}
	c := newClient(o)
	defer c.close()
	eps := append([]endpoint{o.lookup, o.scheduler, o.sender}, o.gpuworkerEndpoints()...)
	rows := make([]serviceStatus, len(eps))
	var wg sync.WaitGroup
	for i, ep := range eps {
		wg.Go(func() { rows[i] = statusOf(ctx, c, ep) })
	}
	wg.Wait()
	var err error
	if o.json {
		err = writeValue(stdout, rows)
	} else {
		err = statusTable(stdout, rows)
	}
	if err != nil {
		return err
	}
	notReady, degraded := 0, 0
	for _, r := range rows {
		switch {
		case !r.Ready:
			notReady++
		case r.Degraded != "":
			degraded++
		}
	}
	switch {
	case notReady > 0:
		return fmt.Errorf("%w: %d of %d not ready", errNotReady, notReady, len(rows))
	case degraded > 0:
		return fmt.Errorf("%w: %d of %d degraded", errDegraded, degraded, len(rows))
	}
	return nil
}

// statusOf reads one service's readiness and metrics.
func statusOf(ctx context.Context, c *client, ep endpoint) serviceStatus {
	s := serviceStatus{Service: ep.name, URL: ep.url}
	ready, err := c.do(ctx, ep, http.MethodGet, httpserver.PathReady, nil, false)
	var pe *problemError
	switch {
	case err == nil:
		s.Ready = true
		s.Degraded = degradedChecks(ready)
	case errors.As(err, &pe):
		s.Error = readyFailure(pe)
	default:
		s.Error = err.Error()
		return s // unreachable: no metrics either
	}
	body, err := c.do(ctx, ep, http.MethodGet, httpserver.PathMetrics, nil, false)
	if err != nil {
		s.MetricsError = err.Error()
		return s
	}
	fams, err := telemetry.ParseExposition(body)
	if err != nil {
		s.MetricsError = err.Error()
		return s
	}
	s.ConsumerLag = telemetry.SumSeries(fams[bus.MetricConsumerLag], "", "")
	s.Counters = deriveCounters(fams, serviceCounters[ep.name])
	return s
}

// readyFailure names the failed readiness checks with their errors.
func readyFailure(pe *problemError) string {
	checks, _ := pe.problem.Extras["checks"].(map[string]any)
	if text := failedChecks(checks); text != "" {
		return "failed checks: " + text
	}
	return pe.Error()
}

// degradedChecks names, with their errors, the optional checks a 200
// /readyz body lists as degraded; "" when there are none or the body is
// not JSON.
func degradedChecks(body []byte) string {
	var ready struct {
		Checks   map[string]any `json:"checks"`
		Degraded []string       `json:"degraded"`
	}
	if json.Unmarshal(body, &ready) != nil || len(ready.Degraded) == 0 {
		return ""
	}
	if text := failedChecks(ready.Checks); text != "" {
		return text
	}
	return strings.Join(ready.Degraded, ", ")
}

// failedChecks lists the checks of a /readyz body whose status is not ok,
// by name, each with its error.
func failedChecks(checks map[string]any) string {
	var parts []string
	for _, name := range slices.Sorted(maps.Keys(checks)) {
		c, _ := checks[name].(map[string]any)
		if status, _ := c["status"].(string); status == httpserver.StatusOK {
			continue
		}
		msg, _ := c["error"].(string)
		parts = append(parts, name+": "+msg)
	}
	return strings.Join(parts, "; ")
}

// deriveCounters computes specs over fams, in order.
func deriveCounters(fams map[string]*dto.MetricFamily, specs []counterSpec) []counter {
	var out []counter
	for _, sp := range specs {
		fam := fams[sp.family]
		if sp.byLabel == "" {
			out = append(out, counter{Name: sp.name, Value: telemetry.SumSeries(fam, sp.label, sp.value)})
			continue
		}
		values := labelValues(fam, sp.byLabel)
		if len(values) == 0 {
			out = append(out, counter{Name: sp.name})
		}
		for _, v := range values {
			out = append(out, counter{Name: sp.name + "." + v, Value: telemetry.SumSeries(fam, sp.byLabel, v)})
		}
	}
	return out
}

// labelValues lists the sorted values of label across fam's series.
func labelValues(fam *dto.MetricFamily, label string) []string {
	var out []string
	for _, m := range fam.GetMetric() {
		if v := telemetry.LabelValue(m, label); v != "" && !slices.Contains(out, v) {
			out = append(out, v)
		}
	}
	slices.Sort(out)
	return out
}

// statusTable prints the rows.
func statusTable(w io.Writer, rows []serviceStatus) error {
	tw := newTable(w, "SERVICE", "URL", "READY", "CONSUMER LAG", "COUNTERS")
	for _, r := range rows {
		ready := "yes"
		switch {
		case !r.Ready:
			ready = "no: " + r.Error
		case r.Degraded != "":
			ready = "degraded: " + r.Degraded
		}
		counters := make([]string, 0, len(r.Counters))
		for _, c := range r.Counters {
			counters = append(counters, c.Name+"="+number(c.Value))
		}
		if r.MetricsError != "" {
			counters = append(counters, "metrics: "+r.MetricsError)
		}
		row(tw, r.Service, r.URL, ready, number(r.ConsumerLag), orDash(strings.Join(counters, " ")))
	}
	return tw.Flush()
}

// number prints v without needless decimals, or "-" when nil.
func number(v *float64) string {
	if v == nil {
		return "-"
	}
	return strconv.FormatFloat(*v, 'f', -1, 64)
}
