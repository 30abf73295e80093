package servicetest

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/config"
	"github.com/kvmesh/kvmesh/pkg/service"
)

// ConfigDoc is the configuration reference, relative to the module root.
const ConfigDoc = "docs/configuration.md"

// CommonSection names the section of ConfigDoc that lists the settings
// every service shares (service.Common), once.
const CommonSection = "common"

// CheckConfigDoc fails the test unless ConfigDoc carries, between the
// markers <!-- config:NAME --> and <!-- /config:NAME -->, exactly the
// configuration table that config.MarkdownTable derives from cfg less the
// shared settings, and between <!-- config:common --> and
// <!-- /config:common --> the table of service.Common: the docs cannot
// drift from the code, and the shared settings are listed once. cfg must
// embed service.Common unchanged. With KVMESH_UPDATE_README=1 it rewrites
// the two sections instead (make docs).
func CheckConfigDoc(t *testing.T, name string, cfg service.Configurable) {
	t.Helper()
	common := config.MarkdownTable(&service.Common{})
	own, err := OwnConfigTable(cfg)
	if err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	path := filepath.Join(testenv.ModuleRoot(t), filepath.FromSlash(ConfigDoc))
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	text := string(data)
	update := os.Getenv("KVMESH_UPDATE_README") == "1"
	changed := false
	for _, s := range []struct{ name, want string }{{CommonSection, common}, {name, own}} {
		next, stale, err := section(text, s.name, s.want)
		if err != nil {
			t.Fatal(err)
		}
		if !stale {
			continue
		}
		if !update {
			t.Errorf("%s: the configuration table %q is stale; run `make docs`.\nwant:\n%s", ConfigDoc, s.name, s.want)
			continue
		}
		text, changed = next, true
	}
	if changed {
		if err := os.WriteFile(path, []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

// OwnConfigTable is the table ConfigDoc lists for a service whose Config is
// cfg: config.MarkdownTable(cfg) without the rows of the shared settings
// (service.Common), which ConfigDoc lists once. It fails when cfg does not
// carry every shared setting unchanged.
func OwnConfigTable(cfg any) (string, error) {
	return ownTable(config.MarkdownTable(cfg), config.MarkdownTable(&service.Common{}))
}

// section replaces the body of the section called name in text with want.
// It reports whether the body differed, and an error when the markers are
// missing.
func section(text, name, want string) (string, bool, error) {
	begin, end := "<!-- config:"+name+" -->\n", "<!-- /config:"+name+" -->"
	i := strings.Index(text, begin)
	if i < 0 {
		return "", false, fmt.Errorf("%s has no %q … %q section", ConfigDoc, strings.TrimSpace(begin), end)
	}
	j := strings.Index(text[i:], end)
	if j < 0 {
		return "", false, fmt.Errorf("%s: %q has no closing %q", ConfigDoc, strings.TrimSpace(begin), end)
	}
	j += i
	if text[i+len(begin):j] == want {
		return text, false, nil
	}
	return text[:i+len(begin)] + want + text[j:], true, nil
}

// ownTable is full, the table of a service's whole Config, without the rows
// of common (the table of service.Common; header rows first in both). It
// fails when a row of common is not in full verbatim: a Config that does not
// embed service.Common, or shadows one of its settings.
func ownTable(full, common string) (string, error) {
	commonRows := strings.SplitAfter(common, "\n")
	const header = 2
	shared := make(map[string]bool, len(commonRows))
	for _, row := range commonRows[header:] {
		if row != "" {
			shared[row] = true
		}
	}
	var b strings.Builder
	found := 0
	for k, row := range strings.SplitAfter(full, "\n") {
		switch {
		case k < header:
			b.WriteString(row)
		case shared[row]:
			found++
		default:
			b.WriteString(row)
		}
	}
	if found != len(shared) {
		return "", fmt.Errorf("the Config lists %d of the %d shared settings unchanged: it must embed service.Common", found, len(shared))
	}
	return b.String(), nil
}
