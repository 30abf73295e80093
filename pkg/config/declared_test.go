package config_test

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"maps"
	"path/filepath"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/kvmesh/kvmesh/internal/testenv"
)

// TestSettingsDeclaredOnce parses every non-test Go file of the module and
// holds each setting to one declaration: an env:"NAME" struct tag names
// NAME in exactly one struct field (a setting several programs read lives
// in one struct they embed), and no tag states a default (defaults are Go
// values, set by the struct's SetDefaults).
func TestSettingsDeclaredOnce(t *testing.T) {
	root := testenv.ModuleRoot(t)
	decls := map[string][]string{}
	fset := token.NewFileSet()
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		name := d.Name()
		if d.IsDir() {
			if path != root && (strings.HasPrefix(name, ".") || name == "testdata" || name == "vendor" || name == "node_modules") {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(name, ".go") || strings.HasSuffix(name, "_test.go") {
			return nil
		}
		f, err := parser.ParseFile(fset, path, nil, parser.SkipObjectResolution)
		if err != nil {
			return err
		}
		ast.Inspect(f, func(n ast.Node) bool {
			field, ok := n.(*ast.Field)
			if !ok || field.Tag == nil {
				return true
			}
			raw, err := strconv.Unquote(field.Tag.Value)
			if err != nil {
				return true
			}
			tag := reflect.StructTag(raw)
			env, ok := tag.Lookup("env")
			if !ok {
				return true
			}
			pos := fset.Position(field.Pos())
			rel, _ := filepath.Rel(root, pos.Filename)
			at := filepath.ToSlash(rel) + ":" + strconv.Itoa(pos.Line)
			decls[env] = append(decls[env], at)
			if def, ok := tag.Lookup("default"); ok {
				t.Errorf("%s: %s has a default tag %q; set it in the struct's SetDefaults", at, env, def)
			}
			return true
		})
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(decls) < 50 {
		t.Fatalf("found %d settings; the walk missed the module's Config structs", len(decls))
	}
	for _, env := range slices.Sorted(maps.Keys(decls)) {
		if at := decls[env]; len(at) > 1 {
			t.Errorf("%s is declared in %d struct fields, want one (embed a shared struct): %s", env, len(at), strings.Join(at, ", "))
		}
	}
}
