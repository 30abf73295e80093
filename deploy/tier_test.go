package deploy_test

import (
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/kvmesh/kvmesh/deploy"
	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/config"
	"github.com/kvmesh/kvmesh/pkg/kvtier"
)

// composeTierURL is the KVMESH_TIER_URL docker-compose.yml's comments turn
// the capacity tier on with: the bucket of its tier service.
const composeTierURL = "http://tier:7070/kvmesh"

// tierService is the compose service of the tier's S3 server, and the
// profile it is in.
const tierService = "tier"

// tierVars are the tier settings docker-compose.yml passes through.
var tierVars = []string{"KVMESH_TIER_URL", "KVMESH_TIER_ACCESS_KEY", "KVMESH_TIER_SECRET_KEY", "KVMESH_TIER_REGION"}

// configDirs are the packages of the programs' Config types, read from
// source (deploy.ConfigFields): this package cannot import them.
var configDirs = map[string]string{
	"lookup":    "services/lookup/internal/app",
	"scheduler": "services/scheduler/internal/app",
	"sender":    "services/sender/internal/app",
	"gpuworker": "services/gpuworker/internal/app",
}

// programFields reads every program's Config settings from source.
func programFields(t *testing.T, root string) map[string][]config.Field {
	t.Helper()
	out := map[string][]config.Field{}
	for program, dir := range configDirs {
		fs, err := deploy.ConfigFields(root, dir, "Config")
		if err != nil {
			t.Fatal(err)
		}
		out[program] = fs
	}
	return out
}

// tierPrograms returns the programs whose Config reads the tier's settings
// (service.Tier), sorted: every compose service running one gets them, no
// other. The gpuworkers, which write and read the tier, must be among them.
func tierPrograms(t *testing.T, fields map[string][]config.Field) []string {
	t.Helper()
	var out []string
	for program, fs := range fields {
		if slices.ContainsFunc(fs, func(f config.Field) bool { return f.Env == "KVMESH_TIER_URL" }) {
			out = append(out, program)
		}
	}
	slices.Sort(out)
	if !slices.Contains(out, "gpuworker") {
		t.Fatalf("programs reading KVMESH_TIER_URL %v: the gpuworker is not among them", out)
	}
	return out
}

// composeData reads the repository's compose file.
func composeData(t *testing.T) ([]byte, string) {
	t.Helper()
	root := testenv.ModuleRoot(t)
	data, err := os.ReadFile(filepath.Join(root, deploy.ComposeFile))
	if err != nil {
		t.Fatal(err)
	}
	return data, root
}

// composeWith loads the compose file (every profile) as compose would with
// the variables in env set and every other one unset.
func composeWith(t *testing.T, data []byte, env map[string]string) *deploy.Compose {
	t.Helper()
	c, err := deploy.ParseCompose(data, func(k string) (string, bool) { v, ok := env[k]; return v, ok })
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// tierServices returns the compose services that run one of programs,
// sorted.
func tierServices(c *deploy.Compose, programs []string) []string {
	var out []string
	for _, p := range programs {
		out = append(out, c.ProgramServices(p)...)
	}
	slices.Sort(out)
	return out
}

// tierScript returns the tier service's shell script: its entrypoint is
// /bin/sh -c and the command the script.
func tierScript(t *testing.T, s deploy.Service) string {
	t.Helper()
	if !slices.Equal(s.Entrypoint, deploy.StringList{"/bin/sh", "-c"}) || len(s.Command) != 1 {
		t.Fatalf("tier: entrypoint %q command %q, want /bin/sh -c and one script", s.Entrypoint, s.Command)
	}
	return s.Command[0]
}

// versitygwArgs returns the arguments of the script's `exec versitygw`.
func versitygwArgs(t *testing.T, script string) []string {
	t.Helper()
	_, run, ok := strings.Cut(script, "exec versitygw ")
	if !ok {
		t.Fatalf("tier script %q does not exec versitygw", script)
	}
	return strings.Fields(run)
}

// flagValue returns the value of flag in args ("" when absent).
func flagValue(args []string, flag string) string {
	if i := slices.Index(args, flag); i >= 0 && i+1 < len(args) {
		return args[i+1]
	}
	return ""
}

// TestDeployTierServer checks the tier's S3 server: versitygw, pinned,
// only in the profile tier, listening on the port of composeTierURL with a
// health check on it, its posix backend's data and metadata on a named
// volume, and the bucket of composeTierURL made (a directory of the posix
// data directory) before the server starts, so that it exists before any
// service that needs it starts.
func TestDeployTierServer(t *testing.T) {
	data, _ := composeData(t)
	c := composeWith(t, data, nil)
	s, ok := c.Services[tierService]
	if !ok {
		t.Fatalf("no %s service", tierService)
	}
	if s.Image != "versity/versitygw:v1.8.0" {
		t.Errorf("tier image %q, want versity/versitygw:v1.8.0", s.Image)
	}
	if !slices.Equal(s.Profiles, []string{tierService}) {
		t.Errorf("tier profiles %v, want [%s]", s.Profiles, tierService)
	}
	loc, err := kvtier.ParseURL(composeTierURL)
	if err != nil {
		t.Fatal(err)
	}
	host, port, _ := strings.Cut(loc.Endpoint, ":")
	if host != tierService || !slices.Contains(c.ListenPorts(tierService), port) {
		t.Errorf("%s: the tier service %s listens on %v", composeTierURL, tierService, c.ListenPorts(tierService))
	}
	script := tierScript(t, s)
	args := versitygwArgs(t, script)
	if p := flagValue(args, "--port"); p != ":"+port {
		t.Errorf("versitygw --port %q, want :%s (all interfaces: the services reach it by name)", p, port)
	}
	i := slices.Index(args, "posix")
	if i < 0 || i == len(args)-1 {
		t.Fatalf("versitygw %q: want the posix backend and its data directory", args)
	}
	dataDir, sidecar := args[len(args)-1], flagValue(args[i:], "--sidecar")
	if sidecar == "" {
		t.Errorf("versitygw %q: want --sidecar (metadata in files: no extended attributes needed on the volume)", args)
	}
	mkdir, _, _ := strings.Cut(script, "&&")
	if made := strings.Fields(mkdir); len(made) < 3 || made[0] != "mkdir" || made[1] != "-p" ||
		!slices.Contains(made, path.Join(dataDir, loc.Bucket)) || !slices.Contains(made, sidecar) {
		t.Errorf("tier script %q: want `mkdir -p %s %s && exec versitygw ...`: the bucket made before the server starts",
			script, path.Join(dataDir, loc.Bucket), sidecar)
	}
	// The data and the metadata on a named volume.
	var volume string
	for _, v := range s.Volumes {
		if v.Type == "volume" && (dataDir == v.Target || strings.HasPrefix(dataDir, v.Target+"/")) &&
			(sidecar == v.Target || strings.HasPrefix(sidecar, v.Target+"/")) {
			volume = v.Source
		}
	}
	if _, ok := c.Volumes[volume]; volume == "" || !ok {
		t.Errorf("tier volumes %+v: want a declared named volume holding %s and %s", s.Volumes, dataDir, sidecar)
	}
	health := flagValue(args, "--health")
	if hc := s.Healthcheck; health == "" || hc == nil || hc.Disable ||
		!slices.Contains(hc.Test, "http://127.0.0.1:"+port+health) {
		t.Errorf("tier health check %+v, versitygw --health %q: want a check of http://127.0.0.1:%s%s", s.Healthcheck, health, port, health)
	}
	for _, k := range []string{"ROOT_ACCESS_KEY_ID", "ROOT_SECRET_ACCESS_KEY"} {
		if s.Environment[k] == "" {
			t.Errorf("tier: %s is empty: versitygw needs root credentials", k)
		}
	}
}

// TestDeployTierOffByDefault checks the tier is off in a plain `docker
// compose up`: the services whose Config reads its settings (the lookup
// and the gpuworkers, as the code stands) get an empty KVMESH_TIER_URL and
// no credentials, the others none of its settings, and only the former
// depend on the tier's server, optionally (a plain up does not run it).
func TestDeployTierOffByDefault(t *testing.T) {
	c, root := compose(t)
	readers := tierServices(c, tierPrograms(t, programFields(t, root)))
	if !slices.Contains(readers, "gpuworker") || !slices.Contains(readers, "gpuworker-prefill") {
		t.Fatalf("services reading the tier settings %v, want both gpuworkers among them", readers)
	}
	for name, s := range c.Services {
		reads := slices.Contains(readers, name)
		for _, k := range tierVars {
			if _, ok := s.Environment[k]; ok != reads {
				t.Errorf("%s: sets %s %v, want %v", name, k, ok, reads)
			}
		}
		for _, k := range []string{"KVMESH_TIER_URL", "KVMESH_TIER_ACCESS_KEY", "KVMESH_TIER_SECRET_KEY"} {
			if v := s.Environment[k]; v != "" {
				t.Errorf("%s: %s %q with nothing set, want empty (the tier off)", name, k, v)
			}
		}
		d, ok := s.DependsOn[tierService]
		switch {
		case ok != reads:
			t.Errorf("%s: depends on %s %v, want %v", name, tierService, ok, reads)
		case ok && (d.Condition != deploy.ConditionHealthy || d.Required):
			t.Errorf("%s: depends on %s with %+v, want %s and required: false", name, tierService, d, deploy.ConditionHealthy)
		}
	}
}

// TestDeployTierProfile turns the tier on as docker-compose.yml's comments
// say — KVMESH_TIER_URL=composeTierURL with the profile tier — and checks
// every service that reads the tier's settings gets that URL and the
// server's own credentials (the development ones, else those set), in an
// environment its Config reads and loads, pointing at a service it waits
// for; that the profile adds the server and a plain up still loads
// without it.
func TestDeployTierProfile(t *testing.T) {
	data, root := composeData(t)
	if doc := "KVMESH_TIER_URL=" + composeTierURL + " docker compose --profile " + tierService + " up"; !strings.Contains(string(data), doc) {
		t.Errorf("%s does not say how to turn the tier on (%q)", deploy.ComposeFile, doc)
	}
	fields := programFields(t, root)
	programs := tierPrograms(t, fields)
	for _, set := range []map[string]string{
		{"KVMESH_TIER_URL": composeTierURL},
		{"KVMESH_TIER_URL": composeTierURL + "/prod", "KVMESH_TIER_ACCESS_KEY": "operator-access", "KVMESH_TIER_SECRET_KEY": "operator-secret", "KVMESH_TIER_REGION": "eu-west-1"},
	} {
		c := composeWith(t, data, set)
		server := c.Services[tierService].Environment
		want := map[string]string{
			"KVMESH_TIER_URL": set["KVMESH_TIER_URL"], "KVMESH_TIER_ACCESS_KEY": server["ROOT_ACCESS_KEY_ID"],
			"KVMESH_TIER_SECRET_KEY": server["ROOT_SECRET_ACCESS_KEY"], "KVMESH_TIER_REGION": server["VGW_REGION"],
		}
		for k, v := range set {
			if k != "KVMESH_TIER_URL" && want[k] != v {
				t.Errorf("with %s=%s the server has %q", k, v, want[k])
			}
		}
		for _, name := range tierServices(c, programs) {
			s := c.Services[name]
			for k, v := range want {
				if got := s.Environment[k]; got != v || v == "" {
					t.Errorf("with %v: %s: %s %q, want %q (the tier server's)", set, name, k, got, v)
				}
			}
			for _, err := range c.CheckEndpoints(name) {
				t.Errorf("with %v: %v", set, err)
			}
			fs := fields[s.Program()]
			for _, err := range deploy.CheckEnvironment(name, s.Environment, fs, deploy.ConfigPrototype(fs)) {
				t.Errorf("with %v: %v", set, err)
			}
		}
	}
	lookup := func(k string) (string, bool) {
		return map[string]string{"KVMESH_TIER_URL": composeTierURL}[k], k == "KVMESH_TIER_URL"
	}
	for _, tc := range []struct {
		profiles []string
		tier     bool
	}{{nil, false}, {[]string{"sim"}, false}, {[]string{tierService}, true}, {[]string{"sim", tierService}, true}} {
		c, err := deploy.ParseComposeProfiles(data, lookup, tc.profiles)
		if err != nil {
			t.Errorf("profiles %v: %v", tc.profiles, err)
			continue
		}
		if _, ok := c.Services[tierService]; ok != tc.tier {
			t.Errorf("profiles %v: the tier server runs %v, want %v", tc.profiles, ok, tc.tier)
		}
		if _, ok := c.Services["lookup"]; !ok {
			t.Errorf("profiles %v: no lookup", tc.profiles)
		}
	}
	// The check above can fail: a required dependency on the server
	// breaks a plain up.
	broken := strings.ReplaceAll(string(data), "required: false", "required: true")
	if _, err := deploy.ParseComposeProfiles([]byte(broken), lookup, nil); err == nil {
		t.Error("a required dependency on the tier server loads without its profile")
	}
}
