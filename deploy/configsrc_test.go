package deploy_test

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvmesh/kvmesh/deploy"
	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/config"
	"github.com/kvmesh/kvmesh/pkg/service"
)

// TestConfigFieldsMatchReflection holds the source reader to config.Describe
// on a Config it can import: the same settings, in the same order, with the
// same tags and types. Defaults are not compared: a Config may take them
// from Go values (config.Defaulter), which the source reader cannot
// evaluate, and the chart checks need none.
func TestConfigFieldsMatchReflection(t *testing.T) {
	root := testenv.ModuleRoot(t)
	got, err := deploy.ConfigFields(root, "pkg/service", "Common")
	if err != nil {
		t.Fatal(err)
	}
	want := config.Describe(&service.Common{})
	if len(got) != len(want) || len(want) == 0 {
		t.Fatalf("got %d fields, want %d", len(got), len(want))
	}
	for i := range want {
		w, g := want[i], got[i]
		w.Value, w.Default, g.Default = "", "", ""
		if g != w {
			t.Errorf("field %d: got %+v, want %+v", i, got[i], w)
		}
	}
}

// configDocs are the files that may carry the configuration tables the
// services' own tests derive from config.MarkdownTable(cfg), between
// <!-- config:NAME --> markers (a service's table, perhaps less the shared
// settings, which then have a "common" section).
var configDocs = []string{"docs/configuration.md", "README.md"}

// TestConfigFieldsMatchDocs holds the source reader to the services'
// internal Configs through the generated configuration tables that their
// own tests hold to config.MarkdownTable(cfg): the prototype built from the
// fields read from source renders the same rows (the service's and the
// shared ones).
func TestConfigFieldsMatchDocs(t *testing.T) {
	root := testenv.ModuleRoot(t)
	for _, program := range []string{"lookup", "scheduler", "sender", "gpuworker"} {
		t.Run(program, func(t *testing.T) {
			fields, err := deploy.ConfigFields(root, filepath.Join("services", program, "internal", "app"), "Config")
			if err != nil {
				t.Fatal(err)
			}
			documented, ok := documentedRows(t, root, program)
			if !ok {
				t.Fatalf("no %v carries a %s configuration table", configDocs, program)
			}
			generated := tableRows(config.MarkdownTable(deploy.ConfigPrototype(fields)))
			if len(generated) != len(fields) || len(fields) == 0 {
				t.Fatalf("%d rows for %d fields", len(generated), len(fields))
			}
			for row := range generated {
				if !documented[row] {
					t.Errorf("read from source but not documented: %s", row)
				}
			}
			for row := range documented {
				if !generated[row] {
					t.Errorf("documented but not read from source: %s", row)
				}
			}
		})
	}
}

// documentedRows returns the rows of program's table and of the shared
// settings' table, from the first of configDocs that has program's.
func documentedRows(t *testing.T, root, program string) (map[string]bool, bool) {
	t.Helper()
	for _, doc := range configDocs {
		data, err := os.ReadFile(filepath.Join(root, filepath.FromSlash(doc)))
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		own, ok := docSection(string(data), program)
		if !ok {
			continue
		}
		rows := tableRows(own)
		if common, ok := docSection(string(data), "common"); ok {
			for row := range tableRows(common) {
				rows[row] = true
			}
		}
		return rows, true
	}
	return nil, false
}

// docSection returns the text between <!-- config:name --> and
// <!-- /config:name -->.
func docSection(text, name string) (string, bool) {
	_, rest, ok := strings.Cut(text, "<!-- config:"+name+" -->\n")
	if !ok {
		return "", false
	}
	section, _, ok := strings.Cut(rest, "<!-- /config:"+name+" -->")
	return section, ok
}

// tableRows returns the setting rows of a Markdown configuration table,
// each with its default cell blanked (see TestConfigFieldsMatchReflection).
func tableRows(table string) map[string]bool {
	rows := map[string]bool{}
	for _, line := range strings.Split(table, "\n") {
		if strings.HasPrefix(line, "| `") {
			cells := strings.Split(line, " | ")
			if len(cells) > 2 {
				cells[2] = ""
			}
			rows[strings.Join(cells, " | ")] = true
		}
	}
	return rows
}

// TestConfigFieldsErrors covers what the source reader refuses.
func TestConfigFieldsErrors(t *testing.T) {
	root := testenv.ModuleRoot(t)
	tests := []struct {
		name, dir, typ string
		want           error
	}{
		{"no such type", "pkg/service", "NoSuchConfig", deploy.ErrNoType},
		{"no such package", "pkg/no-such-package", "Config", os.ErrNotExist},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if _, err := deploy.ConfigFields(root, tt.dir, tt.typ); !errors.Is(err, tt.want) {
				t.Errorf("err %v, want %v", err, tt.want)
			}
		})
	}
}

// TestCheckEnvironment covers what CheckEnvironment reports for an
// environment checked against fields read from source.
func TestCheckEnvironment(t *testing.T) {
	fields, err := deploy.ConfigFields(testenv.ModuleRoot(t), "services/lookup/internal/app", "Config")
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name string
		env  deploy.Environment
		want []string // substrings of the errors, in order; none for a clean one
	}{
		{"clean", deploy.Environment{"KVMESH_REDIS_URL": "redis://r:6379/0", "KVMESH_LOOKUP_TIMEOUT": "3s"}, nil},
		{"unknown variable", deploy.Environment{"KVMESH_REDIS_URL": "redis://r:6379/0", "KVMESH_NO_SUCH": "1"},
			[]string{"sets KVMESH_NO_SUCH, which its Config does not read"}},
		{"required unset", deploy.Environment{}, []string{"required KVMESH_REDIS_URL is not set", "does not load"}},
		{"bad duration", deploy.Environment{"KVMESH_REDIS_URL": "redis://r:6379/0", "KVMESH_LOOKUP_TIMEOUT": "soon"},
			[]string{"does not load"}},
		{"float for an int", deploy.Environment{"KVMESH_REDIS_URL": "redis://r:6379/0", "KVMESH_LOOKUP_MAX_BODY_BYTES": "4.194304e+06"},
			[]string{"does not load"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			errs := deploy.CheckEnvironment("lookup", tt.env, fields, deploy.ConfigPrototype(fields))
			if len(errs) != len(tt.want) {
				t.Fatalf("errors %v, want %d", errs, len(tt.want))
			}
			for i, w := range tt.want {
				if !strings.Contains(errs[i].Error(), w) {
					t.Errorf("error %d %q, want it to say %q", i, errs[i], w)
				}
			}
		})
	}
}
