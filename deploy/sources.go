package deploy

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
)

// MetricPrefixes start the names of the metric families kvmesh serves:
// its own (kvmesh_) and those of vLLM's MooncakeStore connector that it
// serves under vLLM's names (vllm:, see pkg/kvstore's VLLMMetric names).
var MetricPrefixes = []string{"kvmesh_", "vllm:"}

// metricName matches a metric family name that starts with one of
// MetricPrefixes.
var metricName = regexp.MustCompile(`^(?:kvmesh_|vllm:)[a-z0-9_:]*[a-z0-9]$`)

// DefinedMetrics returns the sorted kvmesh_* and vllm:* metric names that non-test Go
// source under root's pkg/ and services/ spells out: every string literal
// that is such a name, and every Namespace/Subsystem/Name composition in a
// composite literal (prometheus.CounterOpts and friends) whose parts are
// string literals. It is a static cross-check; a scrape of the running
// services is the runtime one.
func DefinedMetrics(root string) ([]string, error) {
	var names []string
	for _, dir := range []string{"pkg", "services"} {
		err := filepath.WalkDir(filepath.Join(root, dir), func(path string, d fs.DirEntry, err error) error {
			if err != nil || d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
				return err
			}
			found, err := fileMetrics(path)
			names = append(names, found...)
			return err
		})
		if err != nil {
			return nil, err
		}
	}
	slices.Sort(names)
	return slices.Compact(names), nil
}

// fileMetrics returns the metric names one Go file spells out.
func fileMetrics(path string) ([]string, error) {
	f, err := parser.ParseFile(token.NewFileSet(), path, nil, parser.SkipObjectResolution)
	if err != nil {
		return nil, err
	}
	var out []string
	ast.Inspect(f, func(n ast.Node) bool {
		switch n := n.(type) {
		case *ast.BasicLit:
			if s, ok := stringLit(n); ok && metricName.MatchString(s) {
				out = append(out, s)
			}
		case *ast.CompositeLit:
			if s := composedName(n); metricName.MatchString(s) {
				out = append(out, s)
			}
		}
		return true
	})
	return out, nil
}

// composedName joins the Namespace, Subsystem and Name string fields of a
// composite literal as prometheus.BuildFQName does; empty unless the
// literal has a Name and a Namespace or Subsystem.
func composedName(lit *ast.CompositeLit) string {
	parts := map[string]string{}
	for _, e := range lit.Elts {
		kv, ok := e.(*ast.KeyValueExpr)
		if !ok {
			continue
		}
		key, ok := kv.Key.(*ast.Ident)
		if !ok {
			continue
		}
		if b, ok := kv.Value.(*ast.BasicLit); ok {
			if s, ok := stringLit(b); ok {
				parts[key.Name] = s
			}
		}
	}
	if parts["Name"] == "" || parts["Namespace"] == "" && parts["Subsystem"] == "" {
		return ""
	}
	var nonEmpty []string
	for _, k := range []string{"Namespace", "Subsystem", "Name"} {
		if parts[k] != "" {
			nonEmpty = append(nonEmpty, parts[k])
		}
	}
	return strings.Join(nonEmpty, "_")
}

// stringLit returns the value of a string literal.
func stringLit(b *ast.BasicLit) (string, bool) {
	if b.Kind != token.STRING {
		return "", false
	}
	s, err := strconv.Unquote(b.Value)
	return s, err == nil
}
