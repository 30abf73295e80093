package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"sync"

	"github.com/kvmesh/kvmesh/pkg/adminapi"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/service"
)

func init() {
	register("models", "the models a running mesh serves (GET /v1/models); --check: the lookup, the scheduler and the sender serve the same", runModels)
}

// errModelsDiffer reports a models --check run in which the lookup, the
// scheduler and the sender do not serve the same models.
var errModelsDiffer = errors.New("the services do not serve the same models")

// modelsServices are the services that serve GET /v1/models, in the order
// --check compares them.
var modelsServices = []string{"lookup", "scheduler", "sender"}

// modelsCheck is what `kvmesh models --check --json` prints: each
// service's answer (or why it could not be read) and the differences.
type modelsCheck struct {
	// Services are the answers, by service name.
	Services map[string]*adminapi.ServedModels `json:"services"`
	// Errors say why a service's answer could not be read, by service name.
	Errors map[string]string `json:"errors,omitempty"`
	// Same is true when every service answered the same models (names,
	// fingerprints and default).
	Same bool `json:"same"`
	// Differences name each disagreement, one a line.
	Differences []string `json:"differences"`
}

// runModels prints one service's served models (the lookup's unless
// --service names another), or with --check compares the three services'.
func runModels(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("models", flag.ContinueOnError)
	fs.SetOutput(stderr)
	o := addClientFlags(fs)
	svc := fs.String("service", "lookup", "the service to ask: lookup, scheduler or sender")
	check := fs.Bool("check", false, "ask the lookup, the scheduler and the sender (--service aside) and fail (exit 1), naming the differences, unless they serve the same models (names, fingerprints and default)")
	if rest, err := parseFlags(fs, args); err != nil || len(rest) > 0 {
		return usageOr(err, "models takes no arguments: %q", rest)
	}
	eps := map[string]endpoint{"lookup": o.lookup, "scheduler": o.scheduler, "sender": o.sender}
	ep, ok := eps[*svc]
	if !ok {
		return fmt.Errorf("%w: --service %q is not lookup, scheduler or sender", errUsage, *svc)
	}
	c := newClient(o)
	defer c.close()
	if *check {
		return checkModels(ctx, c, o, eps)
	}
	var served adminapi.ServedModels
	raw, err := c.getJSON(ctx, ep, service.ModelsRoute, nil, &served)
	if err != nil {
		return err
	}
	if o.json {
		return writeJSON(stdout, raw)
	}
	return modelsTable(stdout, served.Items)
}

// checkModels asks every service of modelsServices for its models, at
// once, prints them side by side (or modelsCheck with --json) and returns
// the errors of the services that could not be asked joined with an
// errModelsDiffer error naming the differences; nil when every service
// answered the same.
func checkModels(ctx context.Context, c *client, o *clientOptions, eps map[string]endpoint) error {
	answers := make([]*adminapi.ServedModels, len(modelsServices))
	errs := make([]error, len(modelsServices))
	var wg sync.WaitGroup
	for i, name := range modelsServices {
		wg.Go(func() {
			var served adminapi.ServedModels
			if _, err := c.getJSON(ctx, eps[name], service.ModelsRoute, nil, &served); err != nil {
				errs[i] = err
				return
			}
			answers[i] = &served
		})
	}
	wg.Wait()
	res := modelsCheck{Services: map[string]*adminapi.ServedModels{}, Errors: map[string]string{}}
	for i, name := range modelsServices {
		if errs[i] != nil {
			res.Errors[name] = errs[i].Error()
			continue
		}
		res.Services[name] = answers[i]
	}
	res.Differences = modelDifferences(modelsServices, answers)
	if res.Differences == nil {
		res.Differences = []string{} // "differences": [] rather than null
	}
	res.Same = len(res.Errors) == 0 && len(res.Differences) == 0
	var err error
	if o.json {
		err = writeValue(stdout, res)
	} else {
		err = modelsMatrix(stdout, modelsServices, answers)
	}
	if err != nil {
		return err
	}
	if len(res.Differences) > 0 {
		errs = append(errs, fmt.Errorf("%w: %s", errModelsDiffer, strings.Join(res.Differences, "; ")))
	}
	if e := errors.Join(errs...); e != nil {
		return e
	}
	fmt.Fprintf(stderr, "%s serve the same %d model(s)\n", joinAnd(modelsServices), len(answers[0].Items))
	return nil
}

// modelDifferences names how the answers of services (answers[i] that of
// services[i]; nil: not read, left out) disagree: a model some serve and
// others not, a model with another fingerprint on some, and another
// default model. The order of the non-default models does not matter.
func modelDifferences(services []string, answers []*adminapi.ServedModels) []string {
	var names []string // every model's name, in the order first met
	by := map[string][]serviceValue{}
	var defaults []serviceValue // each service's default model's name, in service order
	asked := 0
	for i, a := range answers {
		if a == nil {
			continue
		}
		asked++
		def := ""
		for _, m := range a.Items {
			if _, ok := by[m.Name]; !ok {
				names = append(names, m.Name)
			}
			by[m.Name] = append(by[m.Name], serviceValue{m.Fingerprint, services[i]})
			if m.Default {
				def = m.Name
			}
		}
		defaults = append(defaults, serviceValue{def, services[i]})
	}
	var out []string
	if vals := groupBy(defaults); len(vals) > 1 {
		out = append(out, "default model (KVMESH_MODEL): "+describeGroups(vals, true))
	}
	for _, name := range names {
		on := by[name]
		if len(on) < asked {
			var have, lack []string
			for _, s := range on {
				have = append(have, s.service)
			}
			for i, a := range answers {
				if a != nil && !slices.Contains(have, services[i]) {
					lack = append(lack, services[i])
				}
			}
			out = append(out, fmt.Sprintf("model %s: served by %s, not by %s", strconv.Quote(name), joinAnd(have), joinAnd(lack)))
		}
		if vals := groupBy(on); len(vals) > 1 {
			out = append(out, fmt.Sprintf("model %s: fingerprint %s", strconv.Quote(name), describeGroups(vals, false)))
		}
	}
	return out
}

// serviceValue is a value one service answered.
type serviceValue struct{ value, service string }

// valueGroup is one value and the services that have it.
type valueGroup struct {
	value    string
	services []string
}

// groupBy groups ss by their value, in the order the values are first met.
func groupBy(ss []serviceValue) []valueGroup {
	var out []valueGroup
	for _, s := range ss {
		i := slices.IndexFunc(out, func(g valueGroup) bool { return g.value == s.value })
		if i < 0 {
			out = append(out, valueGroup{value: s.value})
			i = len(out) - 1
		}
		out[i].services = append(out[i].services, s.service)
	}
	return out
}

// describeGroups reads "a on lookup and scheduler, b on sender"; quote
// quotes the values.
func describeGroups(gs []valueGroup, quote bool) string {
	parts := make([]string, len(gs))
	for i, g := range gs {
		v := g.value
		if quote {
			v = strconv.Quote(v)
		}
		parts[i] = v + " on " + joinAnd(g.services)
	}
	return strings.Join(parts, ", ")
}

// joinAnd joins words as "a", "a and b" or "a, b and c".
func joinAnd(words []string) string {
	if len(words) < 2 {
		return strings.Join(words, "")
	}
	return strings.Join(words[:len(words)-1], ", ") + " and " + words[len(words)-1]
}

// modelsTable prints the served models, one a row: name, default, the
// compatibility fingerprint, the gpuworkers of one engine and the groups.
func modelsTable(w io.Writer, items []adminapi.ServedModel) error {
	tw := newTable(w, "NAME", "DEFAULT", "FINGERPRINT", "WORKER RANKS", "PARALLEL", "GROUPS")
	for _, m := range items {
		row(tw, m.Name, yesNo(m.Default), m.Fingerprint, m.WorkerRanks, parallelSummary(m.Spec), groupsSummary(m.Spec))
	}
	return tw.Flush()
}

// modelsMatrix prints, one row a model, each service's fingerprint of it
// ("-" where it is not served; "(default)" after the default's).
func modelsMatrix(w io.Writer, services []string, answers []*adminapi.ServedModels) error {
	header := []string{"MODEL"}
	for _, s := range services {
		header = append(header, strings.ToUpper(s))
	}
	tw := newTable(w, header...)
	var names []string
	cells := map[string][]string{}
	for i, a := range answers {
		if a == nil {
			continue
		}
		for _, m := range a.Items {
			if _, ok := cells[m.Name]; !ok {
				names = append(names, m.Name)
				cells[m.Name] = slices.Repeat([]string{"-"}, len(services))
			}
			c := m.Fingerprint
			if m.Default {
				c += " (default)"
			}
			cells[m.Name][i] = c
		}
	}
	for i, a := range answers {
		if a == nil {
			for _, name := range names {
				cells[name][i] = "unreachable"
			}
		}
	}
	for _, name := range names {
		row(tw, append([]any{name}, slicesAny(cells[name])...)...)
	}
	return tw.Flush()
}

// slicesAny converts ss to []any for row.
func slicesAny(ss []string) []any {
	out := make([]any, len(ss))
	for i, s := range ss {
		out[i] = s
	}
	return out
}

// yesNo prints a flag as yes or no.
func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}

// parallelSummary prints a spec's parallel sizes above 1 ("tp8",
// "tp2,pcp2"), "tp1" when none is; "-" without a spec.
func parallelSummary(m *kvcore.Model) string {
	if m == nil {
		return "-"
	}
	p := m.Parallel
	var parts []string
	for _, s := range []struct {
		name string
		size int
	}{{"tp", p.TP}, {"pcp", p.PCP}, {"dcp", p.DCP}, {"pp", p.PP}} {
		if s.size > 1 {
			parts = append(parts, s.name+strconv.Itoa(s.size))
		}
	}
	if len(parts) == 0 {
		return "tp1"
	}
	return strings.Join(parts, ",")
}

// groupsSummary prints a spec's groups as kind/block size, comma-separated
// ("mla/16,mamba/16"), a sliding window's with its window
// ("sliding_window/32:w128"); "-" without a spec.
func groupsSummary(m *kvcore.Model) string {
	if m == nil || len(m.Groups) == 0 {
		return "-"
	}
	parts := make([]string, len(m.Groups))
	for i, g := range m.Groups {
		parts[i] = fmt.Sprintf("%s/%d", g.Kind, g.BlockSize)
		if g.Window > 0 {
			parts[i] += fmt.Sprintf(":w%d", g.Window)
		}
	}
	return strings.Join(parts, ",")
}
