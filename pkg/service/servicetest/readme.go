package servicetest

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvmesh/kvmesh/pkg/config"
	"github.com/kvmesh/kvmesh/pkg/testenv"
)

// CheckREADMEConfig fails the test unless README.md carries, between the
// markers <!-- config:NAME --> and <!-- /config:NAME -->, exactly the
// configuration table that config.MarkdownTable derives from cfg: the docs
// cannot drift from the code. With KVMESH_UPDATE_README=1 it rewrites the
// section instead (make docs).
func CheckREADMEConfig(t *testing.T, name string, cfg any) {
	t.Helper()
	path := filepath.Join(testenv.ModuleRoot(t), "README.md")
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	begin, end := "<!-- config:"+name+" -->\n", "<!-- /config:"+name+" -->"
	text := string(data)
	i, j := strings.Index(text, begin), strings.Index(text, end)
	if i < 0 || j < i {
		t.Fatalf("README.md has no %q … %q section", strings.TrimSpace(begin), end)
	}
	want := config.MarkdownTable(cfg)
	got := text[i+len(begin) : j]
	if got == want {
		return
	}
	if os.Getenv("KVMESH_UPDATE_README") == "1" {
		text = text[:i+len(begin)] + want + text[j:]
		if err := os.WriteFile(path, []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	t.Fatalf("README.md configuration table for %s is stale; run `make docs`.\nwant:\n%s\ngot:\n%s", name, want, got)
}
