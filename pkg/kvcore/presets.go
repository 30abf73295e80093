package kvcore

import (
	"embed"
	"fmt"
	"sort"
	"strings"
)

//go:embed presets/*.yaml
var presetFS embed.FS

// PresetNames lists the shipped model presets.
func PresetNames() []string {
	entries, _ := presetFS.ReadDir("presets") // embedded: cannot fail
	var names []string
	for _, e := range entries {
		names = append(names, strings.TrimSuffix(e.Name(), ".yaml"))
	}
	sort.Strings(names)
	return names
}

// Preset returns a shipped model spec by file name (dense, hybrid-mla-linear,
// hybrid-mla-linear-tp8, full-swa-mamba). Each call returns a fresh copy.
func Preset(name string) (*Model, error) {
	data, err := presetFS.ReadFile("presets/" + name + ".yaml")
	if err != nil {
		return nil, fmt.Errorf("model preset %q: %w (have %s)", name, ErrUnknownModel, strings.Join(PresetNames(), ", "))
	}
	return ParseModel(data)
}
