package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/kvmesh/kvmesh/pkg/config"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/service"
)

func init() {
	register("model", "show a model spec with its parallel layout: worker ranks and each group's store namespaces", runModel)
}

// runModel prints the resolved model on stdout.
func runModel(_ context.Context, args []string) error {
	return showModel(args, os.Stdout)
}

// modelLayout is what `kvmesh model --json` prints: the resolved spec and
// the layout derived from it.
type modelLayout struct {
	// Model is the spec after the parallel overrides.
	Model *kvcore.Model `json:"model"`
	// Fingerprint is the model's compatibility fingerprint: the "fp:"
	// segment of every store key, and stored beside every value.
	Fingerprint string `json:"fingerprint"`
	// WorldSize is the number of worker ranks (gpuworkers) per engine.
	WorldSize int `json:"world_size"`
	// WorkerRanks are the worker ranks in order.
	WorkerRanks []kvcore.Rank `json:"worker_ranks"`
	// Groups describe each group's namespaces.
	Groups []groupLayout `json:"groups"`
}

// groupLayout is one group's share of the layout.
type groupLayout struct {
	Kind        kvcore.Kind `json:"kind"`
	Replication int         `json:"replication"`
	Namespaces  []string    `json:"namespaces"`
}

// showModel resolves -model with the -tp/-pcp/-dcp/-pp overrides (default:
// KVMESH_MODEL and KVMESH_TP/PCP/DCP/PP) and writes its layout to out: a
// table, the world size alone (-world-size, for scripts) or JSON (-json).
func showModel(args []string, out io.Writer) error {
	fs := flag.NewFlagSet("model", flag.ContinueOnError)
	fs.SetOutput(stderr)
	model := config.Defaults[service.ModelSpec]()
	if err := config.Overlay(&model, os.LookupEnv); err != nil {
		return err
	}
	spec := fs.String("model", model.Model, "model preset or spec file (env KVMESH_MODEL)")
	var o service.ParallelOverride
	if err := config.Load(&o, os.LookupEnv); err != nil {
		return err
	}
	fs.IntVar(&o.TP, "tp", o.TP, "tensor-parallel size over the spec's (env KVMESH_TP; 0: the spec's)")
	fs.IntVar(&o.PCP, "pcp", o.PCP, "prefill context-parallel size (env KVMESH_PCP)")
	fs.IntVar(&o.DCP, "dcp", o.DCP, "decode context-parallel size (env KVMESH_DCP)")
	fs.IntVar(&o.PP, "pp", o.PP, "pipeline-parallel size (env KVMESH_PP)")
	world := fs.Bool("world-size", false, "print only the number of worker ranks per engine")
	ranks := fs.Bool("ranks", false, "print the worker ranks, one a line: tp pcp dcp pp (for scripts)")
	asJSON := fs.Bool("json", false, "print the layout as JSON")
	rest, err := parseFlags(fs, args)
	if err != nil {
		return err
	}
	if len(rest) > 0 {
		return fmt.Errorf("%w: unexpected arguments %q", errUsage, rest)
	}
	m, err := service.LoadModel(*spec)
	if err != nil {
		return err
	}
	if err := o.Apply(m); err != nil {
		return err
	}
	l := layoutOf(m)
	switch {
	case *world:
		_, err = fmt.Fprintln(out, l.WorldSize)
	case *ranks:
		var b strings.Builder
		for _, r := range l.WorkerRanks {
			fmt.Fprintf(&b, "%d %d %d %d\n", r.TP, r.PCP, r.DCP, r.PP)
		}
		_, err = io.WriteString(out, b.String())
	case *asJSON:
		enc := json.NewEncoder(out)
		enc.SetIndent("", "  ")
		err = enc.Encode(l)
	default:
		err = writeLayout(out, l)
	}
	return err
}

func layoutOf(m *kvcore.Model) modelLayout {
	l := modelLayout{Model: m, Fingerprint: m.Fingerprint(), WorldSize: m.WorldSize(), WorkerRanks: m.WorkerRanks()}
	kb := kvcore.KeysOf(m)
	for g, grp := range m.Groups {
		gl := groupLayout{Kind: grp.Kind, Replication: m.Replication(g)}
		for _, r := range m.Namespaces(g) {
			gl.Namespaces = append(gl.Namespaces, kb.Namespace(r, g))
		}
		l.Groups = append(l.Groups, gl)
	}
	return l
}

func writeLayout(out io.Writer, l modelLayout) error {
	p := l.Model.Parallel
	var b strings.Builder
	fmt.Fprintf(&b, "model        %s (fingerprint %s)\n", l.Model.Name, l.Fingerprint)
	engine := l.Model.EngineVersion
	if engine == "" {
		engine = "(not stated)"
	}
	fmt.Fprintf(&b, "layout       kv_dtype %s  layout_version %d  engine_version %s\n", l.Model.EffectiveKVDtype(), l.Model.EffectiveLayoutVersion(), engine)
	fmt.Fprintf(&b, "parallel     tp %d  pcp %d  dcp %d  pp %d  kv_heads %d\n", max(p.TP, 1), max(p.PCP, 1), max(p.DCP, 1), max(p.PP, 1), l.Model.KVHeads)
	fmt.Fprintf(&b, "worker ranks %d per engine (one gpuworker each)\n", l.WorldSize)
	for g, gl := range l.Groups {
		fmt.Fprintf(&b, "group %d      %s, block %d: %d namespace(s), each chunk written once by one of %d rank(s) sharing it, loaded by every rank\n",
			g, gl.Kind, l.Model.Groups[g].BlockSize, len(gl.Namespaces), gl.Replication)
		for _, ns := range gl.Namespaces {
			fmt.Fprintf(&b, "               %s@<hash>\n", ns)
		}
	}
	_, err := io.WriteString(out, b.String())
	return err
}
