package deploy

import (
	"errors"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"time"

	"github.com/kvmesh/kvmesh/pkg/config"
)

// ModulePath is the module path of this repository (go.mod), used to map
// an import path to a directory under the module root.
const ModulePath = "github.com/kvmesh/kvmesh"

// ErrNoType reports a Go type that ConfigFields cannot find.
var ErrNoType = errors.New("type not found")

// ConfigFields reads the settings of the struct type typeName declared in
// the Go package in dir (relative to root) from its source, as
// config.Describe would list them for a value of that type: in declaration
// order, untagged embedded or nested struct fields flattened (resolved
// through the file's imports when they are declared in another package of
// this module). It is how a test outside a service's tree reads that
// service's internal Config, which it cannot import. Value and Default are
// left empty (defaults are Go values set by the Config's SetDefaults,
// which source cannot evaluate; the deployment checks need none); Type is
// derived from the field's type expression (int, uint, float,
// string, bool, duration for time.Duration, list for []string, text for
// any other named type).
func ConfigFields(root, dir, typeName string) ([]config.Field, error) {
	r := &sourceReader{root: root, pkgs: map[string][]*ast.File{}}
	fields, err := r.structFields(dir, typeName, 0)
	if err != nil {
		return nil, fmt.Errorf("config fields of %s.%s: %w", dir, typeName, err)
	}
	return fields, nil
}

// sourceReader parses packages of the module once each.
type sourceReader struct {
	root string
	pkgs map[string][]*ast.File
}

// maxDepth bounds the nesting of flattened structs (and so a cycle).
const maxDepth = 8

// typeSpec finds the declaration of name in the package in dir and the
// file that declares it.
func (r *sourceReader) typeSpec(dir, name string) (*ast.TypeSpec, *ast.File, error) {
	files, ok := r.pkgs[dir]
	if !ok {
		var err error
		files, err = parseDir(filepath.Join(r.root, dir))
		if err != nil {
			return nil, nil, err
		}
		r.pkgs[dir] = files
	}
	for _, f := range files {
		for _, decl := range f.Decls {
			gd, ok := decl.(*ast.GenDecl)
			if !ok || gd.Tok != token.TYPE {
				continue
			}
			for _, spec := range gd.Specs {
				if ts := spec.(*ast.TypeSpec); ts.Name.Name == name {
					return ts, f, nil
				}
			}
		}
	}
	return nil, nil, fmt.Errorf("%w: %s in %s", ErrNoType, name, dir)
}

// parseDir parses the non-test Go files of one package directory.
func parseDir(dir string) ([]*ast.File, error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("read package: %w", err)
	}
	var files []*ast.File
	fset := token.NewFileSet()
	for _, e := range entries {
		name := e.Name()
		if e.IsDir() || !strings.HasSuffix(name, ".go") || strings.HasSuffix(name, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, filepath.Join(dir, name), nil, parser.SkipObjectResolution)
		if err != nil {
			return nil, fmt.Errorf("parse: %w", err)
		}
		files = append(files, f)
	}
	return files, nil
}

// structFields lists the settings of struct type name in dir.
func (r *sourceReader) structFields(dir, name string, depth int) ([]config.Field, error) {
	if depth > maxDepth {
		return nil, fmt.Errorf("%s.%s: structs nested deeper than %d", dir, name, maxDepth)
	}
	ts, file, err := r.typeSpec(dir, name)
	if err != nil {
		return nil, err
	}
	st, ok := ts.Type.(*ast.StructType)
	if !ok {
		return nil, fmt.Errorf("%s.%s is not a struct type", dir, name)
	}
	var out []config.Field
	for _, f := range st.Fields.List {
		exported := len(f.Names) == 0 && ast.IsExported(typeBaseName(f.Type))
		for _, n := range f.Names {
			exported = exported || n.IsExported()
		}
		if !exported {
			continue
		}
		tag := fieldTag(f)
		if env, tagged := tag.Lookup("env"); tagged {
			secret := isTrue(tag.Get("secret"))
			out = append(out, config.Field{
				Env:      env,
				Doc:      tag.Get("doc"),
				Type:     typeExprName(f.Type),
				Secret:   secret,
				Required: isTrue(tag.Get("required")),
			})
			continue
		}
		nested, err := r.nestedStruct(dir, file, f.Type, depth)
		if err != nil {
			return nil, err
		}
		out = append(out, nested...)
	}
	return out, nil
}

// nestedStruct flattens an untagged field whose type is a struct declared
// in this module; other untagged fields are skipped, as config.Load skips
// them.
func (r *sourceReader) nestedStruct(dir string, file *ast.File, expr ast.Expr, depth int) ([]config.Field, error) {
	switch t := expr.(type) {
	case *ast.Ident:
		ts, _, err := r.typeSpec(dir, t.Name)
		if errors.Is(err, ErrNoType) {
			return nil, nil // a predeclared type
		}
		if err != nil {
			return nil, err
		}
		if _, ok := ts.Type.(*ast.StructType); !ok {
			return nil, nil
		}
		return r.structFields(dir, t.Name, depth+1)
	case *ast.SelectorExpr:
		pkgName, ok := t.X.(*ast.Ident)
		if !ok {
			return nil, nil
		}
		path := importPath(file, pkgName.Name)
		rel, inModule := strings.CutPrefix(path, ModulePath+"/")
		if !inModule {
			return nil, nil // e.g. time.Time: not a settings struct
		}
		return r.structFields(filepath.FromSlash(rel), t.Sel.Name, depth+1)
	}
	return nil, nil
}

// importPath returns the import path file binds to name.
func importPath(file *ast.File, name string) string {
	for _, imp := range file.Imports {
		path, err := strconv.Unquote(imp.Path.Value)
		if err != nil {
			continue
		}
		bound := filepath.Base(path)
		if imp.Name != nil {
			bound = imp.Name.Name
		}
		if bound == name {
			return path
		}
	}
	return ""
}

// fieldTag returns a field's struct tag.
func fieldTag(f *ast.Field) reflect.StructTag {
	if f.Tag == nil {
		return ""
	}
	s, err := strconv.Unquote(f.Tag.Value)
	if err != nil {
		return ""
	}
	return reflect.StructTag(s)
}

// typeBaseName is the name an embedded field of type expr has.
func typeBaseName(expr ast.Expr) string {
	switch t := expr.(type) {
	case *ast.Ident:
		return t.Name
	case *ast.SelectorExpr:
		return t.Sel.Name
	case *ast.StarExpr:
		return typeBaseName(t.X)
	}
	return ""
}

// typeExprName names the form of a field's value as config.Describe does.
func typeExprName(expr ast.Expr) string {
	switch t := expr.(type) {
	case *ast.Ident:
		switch {
		case strings.HasPrefix(t.Name, "uint"):
			return "uint"
		case strings.HasPrefix(t.Name, "int"):
			return "int"
		case strings.HasPrefix(t.Name, "float"):
			return "float"
		case t.Name == "string" || t.Name == "bool":
			return t.Name
		}
	case *ast.SelectorExpr:
		if x, ok := t.X.(*ast.Ident); ok && x.Name == "time" && t.Sel.Name == "Duration" {
			return "duration"
		}
	case *ast.ArrayType:
		if t.Len == nil {
			return "list"
		}
	}
	return "text"
}

// isTrue reads a boolean tag as config does.
func isTrue(s string) bool {
	b, err := strconv.ParseBool(s)
	return err == nil && b
}

// textValue stands, in a prototype, for a field whose type parses text
// (encoding.TextUnmarshaler): it takes any text, and config.Describe names
// it text, as it names the original.
type textValue string

// UnmarshalText implements encoding.TextUnmarshaler.
func (v *textValue) UnmarshalText(b []byte) error {
	*v = textValue(b)
	return nil
}

// ConfigPrototype returns a pointer to a new struct whose fields carry the
// env, doc, required and secret tags of fields, with Go types of the
// fields' Type names (text as a string that parses text) and no defaults:
// a value config.Load can fill, so that an environment can
// be checked against settings read by ConfigFields (the values parse as
// their types; required ones are set), and that config.Describe and
// config.MarkdownTable describe as the original. The Config's own Validate
// does not run.
func ConfigPrototype(fields []config.Field) any {
	types := map[string]reflect.Type{
		"string": reflect.TypeFor[string](), "text": reflect.TypeFor[textValue](),
		"bool": reflect.TypeFor[bool](), "int": reflect.TypeFor[int64](), "uint": reflect.TypeFor[uint64](),
		"float": reflect.TypeFor[float64](), "duration": reflect.TypeFor[time.Duration](),
		"list": reflect.TypeFor[[]string](),
	}
	sfs := make([]reflect.StructField, 0, len(fields))
	for i, f := range fields {
		t, ok := types[f.Type]
		if !ok {
			t = types["string"]
		}
		tag := fmt.Sprintf("env:%q", f.Env)
		if f.Doc != "" {
			tag += fmt.Sprintf(" doc:%q", f.Doc)
		}
		if f.Required {
			tag += ` required:"true"`
		}
		if f.Secret {
			tag += ` secret:"true"`
		}
		sfs = append(sfs, reflect.StructField{Name: "F" + strconv.Itoa(i), Type: t, Tag: reflect.StructTag(tag)})
	}
	return reflect.New(reflect.StructOf(sfs)).Interface()
}

// CheckEnvironment reports how env, the environment of the container or
// service called name, disagrees with fields, the settings of the program
// it runs (config.Describe of its Config, or ConfigFields): KVMESH_* and
// OTEL_* variables no field reads, required settings without a value, and,
// when cfg (a pointer to a config struct: the program's Config or a
// ConfigPrototype) is not nil, an environment config.Load rejects.
func CheckEnvironment(name string, env Environment, fields []config.Field, cfg any) []error {
	errs := checkEnvFields(name, env, fields)
	if cfg != nil {
		if err := loadConfig(env, cfg); err != nil {
			errs = append(errs, fmt.Errorf("%s: its environment does not load: %w", name, err))
		}
	}
	return errs
}
