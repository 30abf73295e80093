package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

func TestModelCommand(t *testing.T) {
	cases := []struct {
		name string
		args []string
		want string
	}{
		{"tp8 preset world size", []string{"-model", "hybrid-mla-linear-tp8", "-world-size"}, "8\n"},
		{"override tp", []string{"-model", "dense", "-tp", "4", "-world-size"}, "4\n"},
		{"pp and pcp multiply", []string{"-model", "dense", "-tp", "2", "-pcp", "2", "-pp", "2", "-world-size"}, "8\n"},
		{"ranks for scripts", []string{"-model", "dense", "-tp", "4", "-dcp", "2", "-ranks"}, "0 0 0 0\n1 0 1 0\n2 0 0 0\n3 0 1 0\n"},
		{"table names the shared MLA namespace", []string{"-model", "hybrid-mla-linear-tp8"}, "mla, block 16: 1 namespace(s)"},
		{"table shows the compatibility fields", []string{"-model", "dense"}, "layout       kv_dtype auto  layout_version 1  engine_version (not stated)\n"},
		{"namespaces carry the fingerprint", []string{"-model", "dense"}, "dense-8b@fp:" + mustPreset(t, "dense").Fingerprint() + "@tp_rank:0@"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var out bytes.Buffer
			if err := showModel(tc.args, &out); err != nil {
				t.Fatal(err)
			}
			if !strings.Contains(out.String(), tc.want) {
				t.Fatalf("output %q, want it to contain %q", out.String(), tc.want)
			}
		})
	}
}

func TestModelCommandJSON(t *testing.T) {
	var out bytes.Buffer
	if err := showModel([]string{"-model", "hybrid-mla-linear-tp8", "-json"}, &out); err != nil {
		t.Fatal(err)
	}
	var l modelLayout
	if err := json.Unmarshal(out.Bytes(), &l); err != nil {
		t.Fatal(err)
	}
	if l.WorldSize != 8 || len(l.WorkerRanks) != 8 || len(l.Groups) != 2 || len(l.Groups[0].Namespaces) != 1 || len(l.Groups[1].Namespaces) != 8 {
		t.Fatalf("layout %+v", l)
	}
}

func TestModelCommandRefusesVLLMRefusals(t *testing.T) {
	var out bytes.Buffer
	err := showModel([]string{"-model", "hybrid-mla-linear", "-tp", "2", "-dcp", "2"}, &out)
	if err == nil || !strings.Contains(err.Error(), "hybrid attention") {
		t.Fatalf("hybrid model with DCP: %v, want vLLM's refusal", err)
	}
	if err := showModel([]string{"-nope"}, &out); !errors.Is(err, errUsage) {
		t.Fatalf("bad flag: %v, want a usage error", err)
	}
}

// TestModelCommandEnv: KVMESH_TP is the -tp default, and a value that is
// not a number is an error naming it, never a silent 0.
func TestModelCommandEnv(t *testing.T) {
	t.Setenv("KVMESH_TP", "4")
	var out bytes.Buffer
	if err := showModel([]string{"-model", "dense", "-world-size"}, &out); err != nil || out.String() != "4\n" {
		t.Fatalf("KVMESH_TP=4: %q, %v; want 4", out.String(), err)
	}
	t.Setenv("KVMESH_TP", "abc")
	if err := showModel([]string{"-model", "dense", "-world-size"}, &out); err == nil || !strings.Contains(err.Error(), "KVMESH_TP") {
		t.Fatalf("KVMESH_TP=abc: %v, want an error naming it", err)
	}
}

// mustPreset is preset name, or the test fails.
func mustPreset(t *testing.T, name string) *kvcore.Model {
	t.Helper()
	m, err := kvcore.Preset(name)
	if err != nil {
		t.Fatal(err)
	}
	return m
}
