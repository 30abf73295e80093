package deploy

import (
	"encoding/json"
	"errors"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"net/url"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
)

// ExplorePane is one pane of a Grafana Explore URL: a data source, its
// queries and a time range.
type ExplorePane struct {
	// Datasource is the pane's data source uid (a string: Grafana ignores
	// any other value and opens its default data source).
	Datasource string `json:"datasource"`
	// Queries are the pane's queries, in the panel target's JSON model.
	Queries []Target `json:"queries"`
	// Range is the time range, as Grafana time strings (now-1h, epoch ms).
	Range struct {
		From string `json:"from"`
		To   string `json:"to"`
	} `json:"range"`
}

// ParseExploreURL returns the panes of a Grafana Explore link, by pane id:
// URL schema 1 (/explore?schemaVersion=1&panes={"<id>":{...}}, Grafana 10.1
// and later) or the older left (and right) parameters, which Grafana still
// migrates (their panes are returned as "left" and "right"). The JSON must
// decode into ExplorePane: a data source given as an object, for one, is
// an error, since Grafana would ignore it.
func ParseExploreURL(raw string) (map[string]ExplorePane, error) {
	u, err := url.Parse(raw)
	if err != nil {
		return nil, err
	}
	if path.Base(u.Path) != "explore" {
		return nil, fmt.Errorf("%s: path %q is not Grafana's /explore", raw, u.Path)
	}
	q, err := url.ParseQuery(u.RawQuery)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", raw, err)
	}
	panes := map[string]ExplorePane{}
	decode := func(name, data string) error {
		var p ExplorePane
		if err := json.Unmarshal([]byte(data), &p); err != nil {
			return fmt.Errorf("explore pane %s: %w", name, err)
		}
		panes[name] = p
		return nil
	}
	if q.Has("panes") {
		if v := q.Get("schemaVersion"); v != "1" {
			return nil, fmt.Errorf("%s: schemaVersion %q with panes, want 1", raw, v)
		}
		var byID map[string]json.RawMessage
		if err := json.Unmarshal([]byte(q.Get("panes")), &byID); err != nil {
			return nil, fmt.Errorf("%s: panes: %w", raw, err)
		}
		for id, data := range byID {
			if err := decode(id, string(data)); err != nil {
				return nil, err
			}
		}
	} else {
		for _, side := range []string{"left", "right"} {
			if q.Has(side) {
				if err := decode(side, q.Get(side)); err != nil {
					return nil, err
				}
			}
		}
	}
	if len(panes) == 0 {
		return nil, fmt.Errorf("%s: no panes (or left) parameter", raw)
	}
	return panes, nil
}

// traceQLEquality matches a TraceQL search of one equality on one
// attribute: { span.name = "value" }, the name plain or quoted.
var traceQLEquality = regexp.MustCompile(`^\{\s*(span|resource)?\.("(?:[^"\\]|\\.)+"|[A-Za-z0-9_][A-Za-z0-9_.\-/:]*)\s*=\s*("(?:[^"\\]|\\.)*")\s*\}$`)

// TraceQLEquality parses a TraceQL query of the form
// { scope.attribute = "value" } and returns its scope (span, resource, or
// empty for any), attribute name and value, quotes and escapes removed.
func TraceQLEquality(q string) (scope, attr, value string, err error) {
	m := traceQLEquality.FindStringSubmatch(strings.TrimSpace(q))
	if m == nil {
		return "", "", "", fmt.Errorf("%q is not { scope.attribute = \"value\" }", q)
	}
	attr = m[2]
	if strings.HasPrefix(attr, `"`) {
		if attr, err = strconv.Unquote(attr); err != nil {
			return "", "", "", fmt.Errorf("%q: attribute %s: %w", q, m[2], err)
		}
	}
	if value, err = strconv.Unquote(m[3]); err != nil {
		return "", "", "", fmt.Errorf("%q: value %s: %w", q, m[3], err)
	}
	return m[1], attr, value, nil
}

// grafanaVariable matches a reference to a Grafana variable: $name,
// ${name} or ${name:format}.
var grafanaVariable = regexp.MustCompile(`^\$(?:\{([A-Za-z_][A-Za-z0-9_]*)(?::[a-z]+)?\}|([A-Za-z_][A-Za-z0-9_]*))$`)

// VariableRef returns the name of the Grafana variable that s is a
// reference to, if s is exactly one ($name, ${name}, ${name:format}).
func VariableRef(s string) (string, bool) {
	m := grafanaVariable.FindStringSubmatch(s)
	if m == nil {
		return "", false
	}
	return m[1] + m[2], true
}

// attributePackage is the import path of OpenTelemetry's attribute package.
const attributePackage = "go.opentelemetry.io/otel/attribute"

// attributeSetters are the functions of the attribute package whose first
// argument is an attribute's key, and the methods of attribute.Key that
// make a key-value of the same type.
var attributeSetters = []string{
	"Bool", "BoolSlice", "Float64", "Float64Slice", "Int", "Int64",
	"Int64Slice", "IntSlice", "String", "StringSlice", "Stringer",
}

// OTelAttribute is one place in Go source that names an OpenTelemetry
// attribute.
type OTelAttribute struct {
	// Key is the attribute's name.
	Key string
	// Type is the setter: String, Int, Bool, ... (attribute.String(key, v)
	// or key.String(v) for an attribute.Key), or Key for an
	// attribute.Key(name) conversion that sets no value there.
	Type string
	// File is the source file, relative to the root, with slashes.
	File string
	// Line is the line in File.
	Line int
}

// OTelAttributes returns the OpenTelemetry attributes that non-test Go
// source under root's dirs names, in file and line order: the key of every
// attribute.String(key, v) (and the other setters), every
// attribute.Key(name), and every key.String(v) on a constant or variable
// holding an attribute.Key(name). A key may be a string literal or a
// constant of string literal value declared under dirs (in the same
// package, or pkg.Name of a package of that name). It is a static
// cross-check; a trace of the running services is the runtime one.
func OTelAttributes(root string, dirs ...string) ([]OTelAttribute, error) {
	type file struct {
		rel string
		ast *ast.File
	}
	fset := token.NewFileSet()
	var files []file
	for _, dir := range dirs {
		err := filepath.WalkDir(filepath.Join(root, dir), func(p string, d fs.DirEntry, err error) error {
			if err != nil || d.IsDir() || !strings.HasSuffix(p, ".go") || strings.HasSuffix(p, "_test.go") {
				return err
			}
			f, err := parser.ParseFile(fset, p, nil, parser.SkipObjectResolution)
			if err != nil {
				return err
			}
			rel, _ := filepath.Rel(root, p)
			files = append(files, file{filepath.ToSlash(rel), f})
			return nil
		})
		if err != nil {
			return nil, err
		}
	}
	if len(files) == 0 {
		return nil, errors.New("no Go source under " + strings.Join(dirs, ", "))
	}
	// Constants (and variables) by "package.Name": string literals, and
	// attribute.Key conversions of string literals.
	strs, keys := map[string]string{}, map[string]string{}
	for _, f := range files {
		attr := importName(f.ast, attributePackage)
		for _, decl := range f.ast.Decls {
			g, ok := decl.(*ast.GenDecl)
			if !ok || g.Tok != token.CONST && g.Tok != token.VAR {
				continue
			}
			for _, spec := range g.Specs {
				vs := spec.(*ast.ValueSpec)
				for i, name := range vs.Names {
					if i >= len(vs.Values) {
						break
					}
					id := f.ast.Name.Name + "." + name.Name
					if b, ok := vs.Values[i].(*ast.BasicLit); ok && g.Tok == token.CONST {
						if s, ok := stringLit(b); ok {
							strs[id] = s
						}
					}
					if call, ok := vs.Values[i].(*ast.CallExpr); ok && attr != "" && isSelector(call.Fun, attr, "Key") && len(call.Args) == 1 {
						if b, ok := call.Args[0].(*ast.BasicLit); ok {
							if s, ok := stringLit(b); ok {
								keys[id] = s
							}
						}
					}
				}
			}
		}
	}
	var out []OTelAttribute
	for _, f := range files {
		attr := importName(f.ast, attributePackage)
		pkgs := importedPackages(f.ast)
		// resolve returns the value of a literal, a constant of the file's
		// package or a pkg.Name, looked up in m (strs or keys).
		resolve := func(e ast.Expr, m map[string]string) (string, bool) {
			switch e := e.(type) {
			case *ast.BasicLit:
				if m == nil {
					return stringLit(e)
				}
			case *ast.Ident:
				s, ok := m[f.ast.Name.Name+"."+e.Name]
				return s, ok
			case *ast.SelectorExpr:
				if x, ok := e.X.(*ast.Ident); ok && pkgs[x.Name] != "" {
					s, ok := m[pkgs[x.Name]+"."+e.Sel.Name]
					return s, ok
				}
			}
			return "", false
		}
		str := func(e ast.Expr) (string, bool) {
			if s, ok := resolve(e, nil); ok {
				return s, true
			}
			return resolve(e, strs)
		}
		ast.Inspect(f.ast, func(n ast.Node) bool {
			call, ok := n.(*ast.CallExpr)
			if !ok || len(call.Args) == 0 {
				return true
			}
			sel, ok := call.Fun.(*ast.SelectorExpr)
			if !ok {
				return true
			}
			add := func(key, typ string) {
				out = append(out, OTelAttribute{Key: key, Type: typ, File: f.rel, Line: fset.Position(call.Pos()).Line})
			}
			setter := slices.Contains(attributeSetters, sel.Sel.Name)
			switch {
			case attr != "" && isSelector(sel, attr, sel.Sel.Name) && (setter || sel.Sel.Name == "Key"):
				// attribute.String(key, v), attribute.Key(key)
				if key, ok := str(call.Args[0]); ok {
					add(key, sel.Sel.Name)
				}
			case setter:
				// attribute.Key(name).String(v), or a Key constant's.
				if inner, ok := sel.X.(*ast.CallExpr); ok && attr != "" && isSelector(inner.Fun, attr, "Key") && len(inner.Args) == 1 {
					if key, ok := str(inner.Args[0]); ok {
						add(key, sel.Sel.Name)
					}
				} else if key, ok := resolve(sel.X, keys); ok {
					add(key, sel.Sel.Name)
				}
			}
			return true
		})
	}
	return out, nil
}

// importName returns the name under which f imports importPath, or "".
func importName(f *ast.File, importPath string) string {
	for _, imp := range f.Imports {
		if p, err := strconv.Unquote(imp.Path.Value); err == nil && p == importPath {
			if imp.Name != nil {
				return imp.Name.Name
			}
			return path.Base(p)
		}
	}
	return ""
}

// importedPackages maps the names under which f imports packages to
// their package names (the import path's last element).
func importedPackages(f *ast.File) map[string]string {
	out := map[string]string{}
	for _, imp := range f.Imports {
		p, err := strconv.Unquote(imp.Path.Value)
		if err != nil {
			continue
		}
		name := path.Base(p)
		if imp.Name != nil {
			out[imp.Name.Name] = name
		} else {
			out[name] = name
		}
	}
	return out
}

// isSelector reports whether e is pkg.name.
func isSelector(e ast.Expr, pkg, name string) bool {
	sel, ok := e.(*ast.SelectorExpr)
	if !ok || sel.Sel.Name != name {
		return false
	}
	x, ok := sel.X.(*ast.Ident)
	return ok && x.Name == pkg
}
