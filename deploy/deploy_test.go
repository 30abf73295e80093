package deploy_test

import (
	"bufio"
	"io/fs"
	"maps"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"gopkg.in/yaml.v3"

	"github.com/kvmesh/kvmesh/deploy"
	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/auth"
)

// compose loads the repository's compose file.
func compose(t *testing.T) (*deploy.Compose, string) {
	t.Helper()
	root := testenv.ModuleRoot(t)
	c, err := deploy.LoadCompose(root)
	if err != nil {
		t.Fatal(err)
	}
	return c, root
}

// readYAML decodes one file under root into v.
func readYAML(t *testing.T, root, rel string, v any) {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(root, rel))
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.Unmarshal(data, v); err != nil {
		t.Fatalf("%s: %v", rel, err)
	}
}

// kvmeshServices returns the compose services that run a kvmesh service
// program, sorted.
func kvmeshServices(c *deploy.Compose) []string {
	var out []string
	for _, program := range slices.Sorted(maps.Keys(deploy.ServiceAddrs)) {
		out = append(out, c.ProgramServices(program)...)
	}
	slices.Sort(out)
	return out
}

func TestDeployYAMLFilesParse(t *testing.T) {
	root := testenv.ModuleRoot(t)
	files := []string{deploy.ComposeFile}
	err := filepath.WalkDir(filepath.Join(root, "deploy"), func(path string, d fs.DirEntry, err error) error {
		// Helm templates are YAML only once rendered: deploy/helmtest
		// renders and decodes them.
		if err == nil && d.IsDir() && d.Name() == "templates" && strings.Contains(filepath.ToSlash(path), "/deploy/helm/") {
			return filepath.SkipDir
		}
		if err == nil && !d.IsDir() && (strings.HasSuffix(path, ".yml") || strings.HasSuffix(path, ".yaml")) {
			rel, _ := filepath.Rel(root, path)
			files = append(files, rel)
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{deploy.DatasourcesFile, deploy.DashboardProvider, deploy.PrometheusFile, deploy.CollectorFile, deploy.TempoFile} {
		if !slices.Contains(files, want) {
			t.Errorf("%s is missing", want)
		}
	}
	for _, f := range files {
		var doc map[string]any
		readYAML(t, root, f, &doc)
		if len(doc) == 0 {
			t.Errorf("%s is empty", f)
		}
	}
}

func TestDeployComposeServices(t *testing.T) {
	c, _ := compose(t)
	for _, name := range []string{"kafka", "postgres", "redis", "migrate", "lookup", "scheduler", "sender",
		"gpuworker", "otel-collector", "tempo", "prometheus", "grafana", "sim"} {
		if _, ok := c.Services[name]; !ok {
			t.Errorf("no %s service", name)
		}
	}
	// The services a plain `docker compose up` leaves out: the simulator
	// and the capacity tier's S3 server, each in a profile of its own name.
	optional := map[string]bool{"sim": true, "tier": true}
	for name, s := range c.Services {
		switch {
		case optional[name] && !slices.Equal(s.Profiles, []string{name}):
			t.Errorf("%s: profiles %v, want [%s] so that a plain up does not run it", name, s.Profiles, name)
		case !optional[name] && len(s.Profiles) > 0:
			t.Errorf("%s: profiles %v: a plain `docker compose up` must start it", name, s.Profiles)
		}
		if s.Image == "" {
			t.Errorf("%s: no image", name)
		}
		if tag := s.Image[strings.LastIndex(s.Image, ":")+1:]; !strings.Contains(s.Image, ":") || tag == "latest" {
			t.Errorf("%s: image %q is not pinned to a tag", name, s.Image)
		}
	}
}

func TestDeployComposeDependencies(t *testing.T) {
	c, _ := compose(t)
	for name, s := range c.Services {
		for dep, d := range s.DependsOn {
			target, ok := c.Services[dep]
			if !ok {
				t.Errorf("%s depends on %s, which does not exist", name, dep)
				continue
			}
			switch d.Condition {
			case deploy.ConditionStarted:
			case deploy.ConditionHealthy:
				if target.Healthcheck == nil || target.Healthcheck.Disable {
					t.Errorf("%s waits for %s to be healthy, but it has no health check", name, dep)
				}
			case deploy.ConditionCompleted:
				if target.Restart != "no" {
					t.Errorf("%s waits for %s to complete, but it restarts (%q)", name, dep, target.Restart)
				}
			default:
				t.Errorf("%s: depends on %s with unknown condition %q", name, dep, d.Condition)
			}
			// A service of a profile s does not share may not run with s:
			// compose refuses a required dependency on it.
			if len(target.Profiles) > 0 && d.Required && !slices.ContainsFunc(s.Profiles, func(p string) bool { return slices.Contains(target.Profiles, p) }) {
				t.Errorf("%s depends on %s (profiles %v) as required: a run without the profile would refuse to start; want required: false", name, dep, target.Profiles)
			}
		}
	}
	for _, name := range append([]string{"kafka", "postgres", "redis"}, kvmeshServices(c)...) {
		if hc := c.Services[name].Healthcheck; hc == nil || hc.Disable || len(hc.Test) == 0 {
			t.Errorf("%s has no health check", name)
		}
	}
	if cycle := findCycle(c); cycle != nil {
		t.Errorf("dependency cycle: %v", cycle)
	}
}

// findCycle returns a depends_on cycle, or nil.
func findCycle(c *deploy.Compose) []string {
	state := map[string]int{} // 1 visiting, 2 done
	var path []string
	var visit func(string) []string
	visit = func(n string) []string {
		switch state[n] {
		case 1:
			return append(slices.Clone(path), n)
		case 2:
			return nil
		}
		state[n] = 1
		path = append(path, n)
		for _, dep := range slices.Sorted(maps.Keys(c.Services[n].DependsOn)) {
			if cyc := visit(dep); cyc != nil {
				return cyc
			}
		}
		path = path[:len(path)-1]
		state[n] = 2
		return nil
	}
	for _, n := range slices.Sorted(maps.Keys(c.Services)) {
		if cyc := visit(n); cyc != nil {
			return cyc
		}
	}
	return nil
}

func TestDeployKafkaIsKRaft(t *testing.T) {
	c, _ := compose(t)
	for name, s := range c.Services {
		if strings.Contains(s.Image, "zookeeper") || strings.Contains(name, "zookeeper") {
			t.Errorf("%s: ZooKeeper has no place in a KRaft deployment", name)
		}
	}
	k := c.Services["kafka"]
	env := k.Environment
	if !strings.HasPrefix(k.Image, "apache/kafka:3.9") {
		t.Errorf("kafka image %q, want apache/kafka:3.9.x", k.Image)
	}
	roles := strings.Split(env["KAFKA_PROCESS_ROLES"], ",")
	if !slices.Contains(roles, "broker") || !slices.Contains(roles, "controller") {
		t.Errorf("KAFKA_PROCESS_ROLES %q, want broker,controller", env["KAFKA_PROCESS_ROLES"])
	}
	if env["KAFKA_NODE_ID"] == "" || !strings.HasPrefix(env["KAFKA_CONTROLLER_QUORUM_VOTERS"], env["KAFKA_NODE_ID"]+"@") {
		t.Errorf("node id %q and quorum voters %q disagree", env["KAFKA_NODE_ID"], env["KAFKA_CONTROLLER_QUORUM_VOTERS"])
	}
	if _, ok := env["KAFKA_ZOOKEEPER_CONNECT"]; ok {
		t.Error("KAFKA_ZOOKEEPER_CONNECT is set")
	}
	if !strings.Contains(env["KAFKA_ADVERTISED_LISTENERS"], "://kafka:9092") {
		t.Errorf("advertised listeners %q do not include kafka:9092, the address the services use", env["KAFKA_ADVERTISED_LISTENERS"])
	}
	for _, k := range []string{"KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR", "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR", "KAFKA_DEFAULT_REPLICATION_FACTOR"} {
		if env[k] != "1" {
			t.Errorf("%s = %q on a single broker, want 1", k, env[k])
		}
	}
}

func TestDeployRedisIsAnLRUCache(t *testing.T) {
	c, _ := compose(t)
	cmd := c.Services["redis"].Command
	arg := func(flag string) string {
		if i := slices.Index(cmd, flag); i >= 0 && i+1 < len(cmd) {
			return cmd[i+1]
		}
		return ""
	}
	if arg("--maxmemory-policy") != "allkeys-lru" {
		t.Errorf("redis command %q: want --maxmemory-policy allkeys-lru", cmd)
	}
	if !regexp.MustCompile(`^[0-9]+[kmg]?b?$`).MatchString(strings.ToLower(arg("--maxmemory"))) || arg("--maxmemory") == "0" {
		t.Errorf("redis command %q: want a --maxmemory limit", cmd)
	}
	if arg("--appendonly") != "no" || !slices.Contains(cmd, "--save") {
		t.Errorf("redis command %q: the store pool is a cache, want no persistence", cmd)
	}
}

func TestDeployGrafana(t *testing.T) {
	c, root := compose(t)
	g := c.Services["grafana"]
	if !slices.ContainsFunc(g.Ports, func(p deploy.Port) bool { return p.Published == "3000" && p.Target == "3000" }) {
		t.Errorf("grafana ports %+v, want 3000:3000", g.Ports)
	}
	if g.Environment["GF_AUTH_ANONYMOUS_ENABLED"] != "true" || g.Environment["GF_AUTH_ANONYMOUS_ORG_ROLE"] != "Admin" {
		t.Errorf("grafana: want anonymous admin access, got %v", g.Environment)
	}
	var provider struct {
		Providers []struct {
			Type    string `yaml:"type"`
			Options struct {
				Path string `yaml:"path"`
			} `yaml:"options"`
		} `yaml:"providers"`
	}
	readYAML(t, root, deploy.DashboardProvider, &provider)
	if len(provider.Providers) != 1 || provider.Providers[0].Type != "file" {
		t.Fatalf("dashboard providers %+v, want one file provider", provider.Providers)
	}
	mounts := map[string]string{}
	for _, v := range g.Volumes {
		mounts[filepath.Clean(v.Source)] = v.Target
		if !v.ReadOnly {
			t.Errorf("grafana mounts %s writable, want read-only", v.Source)
		}
	}
	if mounts[filepath.Clean("./"+deploy.DashboardsDir)] != provider.Providers[0].Options.Path {
		t.Errorf("dashboards are mounted at %q, the provider reads %q", mounts[filepath.Clean("./"+deploy.DashboardsDir)], provider.Providers[0].Options.Path)
	}
	if mounts["deploy/grafana/provisioning"] != "/etc/grafana/provisioning" {
		t.Errorf("provisioning mounted at %q, want /etc/grafana/provisioning", mounts["deploy/grafana/provisioning"])
	}
	if home := g.Environment["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]; home != "" {
		rel, ok := strings.CutPrefix(home, provider.Providers[0].Options.Path+"/")
		if _, err := os.Stat(filepath.Join(root, deploy.DashboardsDir, rel)); !ok || err != nil {
			t.Errorf("home dashboard %s is not one of the mounted dashboards", home)
		}
	}
}

func TestDeployMountsExist(t *testing.T) {
	c, root := compose(t)
	for name, s := range c.Services {
		for _, v := range s.Volumes {
			switch v.Type {
			case "bind":
				if _, err := os.Stat(filepath.Join(root, v.Source)); err != nil {
					t.Errorf("%s mounts %s: %v", name, v.Source, err)
				}
			case "volume":
				if _, ok := c.Volumes[v.Source]; !ok {
					t.Errorf("%s mounts volume %s, which is not declared", name, v.Source)
				}
			default:
				t.Errorf("%s: mount %+v of unknown type", name, v)
			}
		}
	}
}

func TestDeployServicesShareOneImage(t *testing.T) {
	c, _ := compose(t)
	shared := map[string]string{}
	for _, name := range append(kvmeshServices(c), deploy.MigrateService, "sim") {
		s := c.Services[name]
		if s.Build == nil || filepath.Clean(s.Build.DockerfilePath()) != deploy.Dockerfile || s.Image != "kvmesh:local" {
			t.Errorf("%s: build %+v image %q, want the root Dockerfile as kvmesh:local", name, s.Build, s.Image)
		}
		if !kvmeshService(name, c) {
			continue
		}
		for _, k := range []string{"KVMESH_MODEL", "KVMESH_KEY_PREFIX", "KVMESH_ADMIN_TOKEN", "KVMESH_KAFKA_BROKERS", "OTEL_EXPORTER_OTLP_ENDPOINT"} {
			v, ok := s.Environment[k]
			if !ok {
				t.Errorf("%s does not set %s", name, k)
			}
			if prev, seen := shared[k]; seen && prev != v {
				t.Errorf("%s: %s = %q, another service has %q: it must be the same everywhere", name, k, v, prev)
			}
			shared[k] = v
		}
	}
	if shared["KVMESH_ADMIN_TOKEN"] == "" {
		t.Error("KVMESH_ADMIN_TOKEN is empty: every mutating admin route would be refused")
	}
}

// TestDeployAuth checks docker-compose.yml authenticates the mesh: every
// kvmesh service and the simulator run with KVMESH_AUTH=required (set
// explicitly, whatever the code's default), one auth key of at least
// auth.MinKeyBytes bytes and one operator token, so that the simulator's
// engine tokens verify at every service and its admin calls are admitted.
// The migration one-shot talks to PostgreSQL only and needs none of them.
func TestDeployAuth(t *testing.T) {
	c, _ := compose(t)
	shared := map[string]string{}
	for _, name := range append(kvmeshServices(c), "sim") {
		env := c.Services[name].Environment
		if got := env["KVMESH_AUTH"]; got != auth.ModeRequired {
			t.Errorf("%s: KVMESH_AUTH %q, want %q", name, got, auth.ModeRequired)
		}
		if key := env["KVMESH_AUTH_KEY"]; len(key) < auth.MinKeyBytes {
			t.Errorf("%s: KVMESH_AUTH_KEY is %d bytes, want at least %d", name, len(key), auth.MinKeyBytes)
		}
		for _, k := range []string{"KVMESH_AUTH", "KVMESH_AUTH_KEY", "KVMESH_ADMIN_TOKEN"} {
			v, ok := env[k]
			if !ok || v == "" {
				t.Errorf("%s does not set %s", name, k)
				continue
			}
			if prev, seen := shared[k]; seen && prev != v {
				t.Errorf("%s: %s = %q, another service has %q: it must be the same in the mesh and the simulator", name, k, v, prev)
			}
			shared[k] = v
		}
	}
	for k := range c.Services[deploy.MigrateService].Environment {
		if strings.HasPrefix(k, "KVMESH_AUTH") || k == "KVMESH_ADMIN_TOKEN" {
			t.Errorf("%s sets %s, which `kvmesh migrate` does not read", deploy.MigrateService, k)
		}
	}
}

// TestDeployAuthCanBeOverridden checks the auth settings come from the
// environment (.env) when set: a deployment replaces the development key
// and token without editing the file, and can turn authentication off.
func TestDeployAuthCanBeOverridden(t *testing.T) {
	root := testenv.ModuleRoot(t)
	data, err := os.ReadFile(filepath.Join(root, deploy.ComposeFile))
	if err != nil {
		t.Fatal(err)
	}
	set := map[string]string{
		"KVMESH_AUTH":        auth.ModeOff,
		"KVMESH_AUTH_KEY":    "a-key-of-the-operator-0123456789abcdef",
		"KVMESH_ADMIN_TOKEN": "an-operator-token",
	}
	c, err := deploy.ParseCompose(data, func(k string) (string, bool) { v, ok := set[k]; return v, ok })
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range append(kvmeshServices(c), "sim") {
		for k, want := range set {
			if got := c.Services[name].Environment[k]; got != want {
				t.Errorf("%s: %s %q with %s=%q in the environment, want it", name, k, got, k, want)
			}
		}
	}
}

func kvmeshService(name string, c *deploy.Compose) bool {
	return slices.Contains(kvmeshServices(c), name)
}

func TestDeployEndpointsOfEveryMeshContainer(t *testing.T) {
	c, _ := compose(t)
	for _, name := range append(kvmeshServices(c), deploy.MigrateService, "sim") {
		for _, err := range c.CheckEndpoints(name) {
			t.Error(err)
		}
	}
	// The simulator talks to every service and both workers.
	eps, err := deploy.Endpoints(c.Services["sim"].Environment)
	if err != nil {
		t.Fatal(err)
	}
	hosts := map[string]bool{}
	for _, ep := range eps {
		hosts[ep.Host] = true
	}
	for _, name := range kvmeshServices(c) {
		if !hosts[name] {
			t.Errorf("sim does not reach %s", name)
		}
	}
}

func TestDeployDockerfile(t *testing.T) {
	root := testenv.ModuleRoot(t)
	df := dockerfileLines(t, root)
	goVersion := goModVersion(t, root)

	froms := grep(df, `^FROM\s+(\S+)`)
	if len(froms) < 2 {
		t.Fatalf("Dockerfile stages %v, want a build stage and a runtime stage", froms)
	}
	builder := froms[0][1]
	if tag, ok := strings.CutPrefix(builder, "golang:"); !ok || !strings.HasPrefix(tag, goVersion+"-") && tag != goVersion {
		t.Errorf("builder %q, want golang:%s (go.mod)", builder, goVersion)
	}
	built := map[string]bool{}
	for _, m := range grep(df, `go build\b.*`) {
		for _, f := range strings.Fields(m[0]) {
			if strings.HasPrefix(f, "./") {
				built[strings.TrimPrefix(f, "./")] = true
			}
		}
	}
	dirs, err := os.ReadDir(filepath.Join(root, "services"))
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"cmd/kvmesh"}
	for _, d := range dirs {
		if d.IsDir() {
			want = append(want, "services/"+d.Name())
		}
	}
	for _, w := range want {
		if !built[w] {
			t.Errorf("the Dockerfile does not build ./%s", w)
		}
	}
	download, copyAll := indexOf(df, "go mod download"), indexOf(df, "COPY . .")
	if download < 0 || copyAll < 0 || download > copyAll || indexOf(df, "COPY go.mod go.sum") > download {
		t.Error("want COPY go.mod go.sum, go mod download, then COPY . . (modules cached in their own layer)")
	}
	if !slices.ContainsFunc(df, func(l string) bool { return strings.HasPrefix(l, "COPY --from=build /out/ /usr/local/bin/") }) {
		t.Error("the runtime stage does not copy /out/ to /usr/local/bin/")
	}
	programs := map[string]bool{}
	for w := range built {
		programs[filepath.Base(w)] = true
	}
	c, _ := compose(t)
	for name, s := range c.Services {
		if s.Image != "kvmesh:local" {
			continue
		}
		if len(s.Entrypoint) == 0 || filepath.Dir(s.Entrypoint[0]) != "/usr/local/bin" || !programs[s.Program()] {
			t.Errorf("%s: entrypoint %q is not a program the Dockerfile builds into /usr/local/bin", name, s.Entrypoint)
		}
		if hc := s.Healthcheck; hc != nil && len(hc.Test) > 1 && hc.Test[0] == "CMD" && !programs[filepath.Base(hc.Test[1])] {
			t.Errorf("%s: health check runs %q, which the image does not have", name, hc.Test[1])
		}
	}
}

// dockerfileLines returns the Dockerfile's instructions, continuation
// lines joined and comments dropped.
func dockerfileLines(t *testing.T, root string) []string {
	t.Helper()
	f, err := os.Open(filepath.Join(root, deploy.Dockerfile))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var out []string
	var cur strings.Builder
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		if s, ok := strings.CutSuffix(line, `\`); ok {
			cur.WriteString(s + " ")
			continue
		}
		cur.WriteString(line)
		out = append(out, cur.String())
		cur.Reset()
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// goModVersion returns go.mod's language version as major.minor.
func goModVersion(t *testing.T, root string) string {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(root, "go.mod"))
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^go (\d+\.\d+)`).FindSubmatch(data)
	if m == nil {
		t.Fatal("go.mod has no go line")
	}
	return string(m[1])
}

func grep(lines []string, pattern string) [][]string {
	re := regexp.MustCompile(pattern)
	var out [][]string
	for _, l := range lines {
		if m := re.FindStringSubmatch(l); m != nil {
			out = append(out, m)
		}
	}
	return out
}

func indexOf(lines []string, substr string) int {
	return slices.IndexFunc(lines, func(l string) bool { return strings.Contains(l, substr) })
}

func TestDeployPrometheusScrapesEveryService(t *testing.T) {
	c, root := compose(t)
	var cfg struct {
		Global struct {
			ScrapeInterval string `yaml:"scrape_interval"`
		} `yaml:"global"`
		ScrapeConfigs []struct {
			JobName       string `yaml:"job_name"`
			MetricsPath   string `yaml:"metrics_path"`
			StaticConfigs []struct {
				Targets []string `yaml:"targets"`
			} `yaml:"static_configs"`
		} `yaml:"scrape_configs"`
	}
	readYAML(t, root, deploy.PrometheusFile, &cfg)
	if cfg.Global.ScrapeInterval != "5s" {
		t.Errorf("scrape_interval %q, want 5s", cfg.Global.ScrapeInterval)
	}
	var jobs, targets []string
	for _, sc := range cfg.ScrapeConfigs {
		jobs = append(jobs, sc.JobName)
		if sc.MetricsPath != "" && sc.MetricsPath != "/metrics" {
			t.Errorf("job %s scrapes %s, want /metrics", sc.JobName, sc.MetricsPath)
		}
		for _, st := range sc.StaticConfigs {
			for _, tg := range st.Targets {
				targets = append(targets, tg)
				host, _, _ := net.SplitHostPort(tg)
				if s, ok := c.Services[host]; !ok || s.Program() != sc.JobName {
					t.Errorf("job %s scrapes %s, which does not run %s", sc.JobName, tg, sc.JobName)
				}
			}
		}
	}
	slices.Sort(jobs)
	if want := slices.Sorted(maps.Keys(deploy.ServiceAddrs)); !slices.Equal(jobs, want) {
		t.Errorf("jobs %v, want one per service %v", jobs, want)
	}
	var want []string
	for _, name := range kvmeshServices(c) {
		_, port, _ := net.SplitHostPort(c.Services[name].Environment["KVMESH_HTTP_ADDR"])
		want = append(want, net.JoinHostPort(name, port))
	}
	slices.Sort(targets)
	slices.Sort(want)
	if !slices.Equal(targets, want) {
		t.Errorf("targets %v, want every service's HTTP address %v", targets, want)
	}
}

func TestDeployCollectorSendsTracesToTempo(t *testing.T) {
	c, root := compose(t)
	var cfg struct {
		Receivers map[string]struct {
			Protocols map[string]struct {
				Endpoint string `yaml:"endpoint"`
			} `yaml:"protocols"`
		} `yaml:"receivers"`
		Exporters map[string]struct {
			Endpoint string `yaml:"endpoint"`
			TLS      struct {
				Insecure bool `yaml:"insecure"`
			} `yaml:"tls"`
		} `yaml:"exporters"`
		Processors map[string]any `yaml:"processors"`
		Service    struct {
			Pipelines map[string]struct {
				Receivers  []string `yaml:"receivers"`
				Processors []string `yaml:"processors"`
				Exporters  []string `yaml:"exporters"`
			} `yaml:"pipelines"`
		} `yaml:"service"`
	}
	readYAML(t, root, deploy.CollectorFile, &cfg)
	p, ok := cfg.Service.Pipelines["traces"]
	if !ok {
		t.Fatal("no traces pipeline")
	}
	if !slices.Contains(p.Receivers, "otlp") || !slices.Contains(p.Processors, "batch") {
		t.Errorf("traces pipeline %+v: want the otlp receiver and the batch processor", p)
	}
	for _, name := range append(slices.Clone(p.Receivers), p.Processors...) {
		_, isRecv := cfg.Receivers[name]
		_, isProc := cfg.Processors[name]
		if !isRecv && !isProc {
			t.Errorf("pipeline uses %s, which is not defined", name)
		}
	}
	proto := cfg.Receivers["otlp"].Protocols
	if !strings.HasSuffix(proto["grpc"].Endpoint, ":4317") || !strings.HasSuffix(proto["http"].Endpoint, ":4318") {
		t.Errorf("otlp receiver %+v: want grpc :4317 and http :4318", proto)
	}
	toTempo := false
	for _, name := range p.Exporters {
		e, ok := cfg.Exporters[name]
		if !ok {
			t.Errorf("pipeline exports to %s, which is not defined", name)
		}
		if strings.HasPrefix(name, "otlp") && e.Endpoint == "tempo:4317" && e.TLS.Insecure {
			toTempo = true
		}
	}
	if !toTempo {
		t.Errorf("traces pipeline exporters %v: none sends OTLP to tempo:4317 (insecure)", p.Exporters)
	}
	if !slices.Contains(c.ListenPorts("tempo"), "4317") {
		t.Errorf("tempo listens on %v, the collector sends to 4317", c.ListenPorts("tempo"))
	}
	if c.Services["otel-collector"].DependsOn["tempo"].Condition == "" {
		t.Error("otel-collector does not depend on tempo")
	}
}

func TestDeployTempo(t *testing.T) {
	root := testenv.ModuleRoot(t)
	var cfg struct {
		Server struct {
			HTTPListenPort int `yaml:"http_listen_port"`
		} `yaml:"server"`
		Distributor struct {
			Receivers struct {
				OTLP struct {
					Protocols map[string]struct {
						Endpoint string `yaml:"endpoint"`
					} `yaml:"protocols"`
				} `yaml:"otlp"`
			} `yaml:"receivers"`
		} `yaml:"distributor"`
		Storage struct {
			Trace struct {
				Backend string `yaml:"backend"`
			} `yaml:"trace"`
		} `yaml:"storage"`
	}
	readYAML(t, root, deploy.TempoFile, &cfg)
	if cfg.Server.HTTPListenPort != 3200 {
		t.Errorf("tempo http port %d, want 3200 (the Grafana data source)", cfg.Server.HTTPListenPort)
	}
	if ep := cfg.Distributor.Receivers.OTLP.Protocols["grpc"].Endpoint; ep != "0.0.0.0:4317" {
		t.Errorf("tempo otlp grpc receiver %q, want 0.0.0.0:4317 (reachable by the collector)", ep)
	}
	if cfg.Storage.Trace.Backend != "local" {
		t.Errorf("tempo storage %q, want local", cfg.Storage.Trace.Backend)
	}
}

func TestDeployDatasources(t *testing.T) {
	c, root := compose(t)
	var cfg struct {
		Datasources []struct {
			UID  string `yaml:"uid"`
			Type string `yaml:"type"`
			URL  string `yaml:"url"`
		} `yaml:"datasources"`
	}
	readYAML(t, root, deploy.DatasourcesFile, &cfg)
	want := map[string]struct{ typ, host, port string }{
		"prometheus": {"prometheus", "prometheus", "9090"},
		"tempo":      {"tempo", "tempo", "3200"},
	}
	seen := map[string]bool{}
	for _, ds := range cfg.Datasources {
		w, ok := want[ds.UID]
		if !ok {
			t.Errorf("unexpected data source uid %q", ds.UID)
			continue
		}
		seen[ds.UID] = true
		u, err := url.Parse(ds.URL)
		if err != nil || ds.Type != w.typ || u.Hostname() != w.host || u.Port() != w.port {
			t.Errorf("data source %s: type %s url %s, want %s at http://%s:%s", ds.UID, ds.Type, ds.URL, w.typ, w.host, w.port)
		}
		if !slices.Contains(c.ListenPorts(w.host), w.port) {
			t.Errorf("data source %s: %s listens on %v", ds.UID, w.host, c.ListenPorts(w.host))
		}
		if _, ok := c.Services["grafana"].DependsOn[w.host]; !ok {
			t.Errorf("grafana does not depend on %s", w.host)
		}
	}
	if len(seen) != len(want) {
		t.Errorf("data sources %v, want uids prometheus and tempo", slices.Sorted(maps.Keys(seen)))
	}
}

func TestDeployDashboards(t *testing.T) {
	root := testenv.ModuleRoot(t)
	dashboards, err := deploy.LoadDashboards(root)
	if err != nil {
		t.Fatal(err)
	}
	var files []string
	uids := map[string]bool{}
	for _, d := range dashboards {
		files = append(files, filepath.Base(d.File))
		if d.UID == "" || uids[d.UID] || d.Title == "" {
			t.Errorf("%s: uid %q title %q: want a unique uid and a title", d.File, d.UID, d.Title)
		}
		uids[d.UID] = true
		if d.SchemaVersion < 36 {
			t.Errorf("%s: schemaVersion %d, want a current one (>= 36)", d.File, d.SchemaVersion)
		}
		checkPanels(t, d)
	}
	for _, want := range []string{"mesh-overview.json", "dead-letters.json", "store.json", "gpu-workers.json"} {
		if !slices.Contains(files, want) {
			t.Errorf("no dashboard %s", want)
		}
	}
}

// checkPanels checks one dashboard's panels: unique ids and titles, a
// provisioned data source, and at least one query each.
func checkPanels(t *testing.T, d deploy.Dashboard) {
	t.Helper()
	uids := map[string]bool{"prometheus": true, "tempo": true}
	ids, titles := map[int]bool{}, map[string]bool{}
	var placed []deploy.Panel
	for _, p := range d.Panels {
		g := p.GridPos
		if g.W < 1 || g.H < 1 || g.X < 0 || g.Y < 0 || g.X+g.W > 24 {
			t.Errorf("%s: panel %q at %+v is off the 24-column grid", d.File, p.Title, g)
		}
		for _, q := range placed {
			if g.Overlaps(q.GridPos) {
				t.Errorf("%s: panels %q and %q overlap", d.File, q.Title, p.Title)
			}
		}
		placed = append(placed, p)
	}
	for _, p := range d.AllPanels() {
		if ids[p.ID] || p.ID == 0 {
			t.Errorf("%s: panel id %d is zero or repeated", d.File, p.ID)
		}
		if titles[p.Title] || p.Title == "" {
			t.Errorf("%s: panel title %q is empty or repeated", d.File, p.Title)
		}
		ids[p.ID], titles[p.Title] = true, true
		if p.Type == "row" || p.Type == "text" {
			continue
		}
		if p.Datasource == nil || !uids[p.Datasource.UID] {
			t.Errorf("%s: panel %q: data source %+v, want uid prometheus or tempo", d.File, p.Title, p.Datasource)
		}
		if len(p.Targets) == 0 {
			t.Errorf("%s: panel %q has no query", d.File, p.Title)
		}
		for _, tg := range p.Targets {
			if tg.Datasource != nil && !uids[tg.Datasource.UID] {
				t.Errorf("%s: panel %q query %s: data source uid %q", d.File, p.Title, tg.RefID, tg.Datasource.UID)
			}
			if tg.Expr == "" && tg.Query == "" {
				t.Errorf("%s: panel %q query %s is empty", d.File, p.Title, tg.RefID)
			}
		}
	}
}

func TestDeployDashboardMetricsAreDefined(t *testing.T) {
	root := testenv.ModuleRoot(t)
	used, err := deploy.DashboardMetrics(root)
	if err != nil {
		t.Fatal(err)
	}
	defined, err := deploy.DefinedMetrics(root)
	if err != nil {
		t.Fatal(err)
	}
	if len(used) < 20 {
		t.Errorf("the dashboards query only %d metrics: %v", len(used), used)
	}
	for _, m := range used {
		if !slices.ContainsFunc(deploy.MetricPrefixes, func(p string) bool { return strings.HasPrefix(m, p) }) {
			t.Errorf("dashboards query %s: only families starting %v, which the live scrape test checks, are allowed", m, deploy.MetricPrefixes)
		}
		if _, found := slices.BinarySearch(defined, m); !found {
			t.Errorf("dashboards query %s, which no Go source under pkg/ or services/ defines", m)
		}
	}
}

func TestDeploySimPlaysTheServicesModel(t *testing.T) {
	c, _ := compose(t)
	sim := c.Services["sim"]
	if !slices.Equal(sim.Entrypoint, deploy.StringList{"/usr/local/bin/kvmesh", "sim"}) {
		t.Errorf("sim entrypoint %q, want kvmesh sim (so that `run sim FLAGS` passes flags)", sim.Entrypoint)
	}
	i := slices.Index(sim.Command, "--model")
	if i < 0 || i+1 == len(sim.Command) {
		t.Fatalf("sim command %q names no --model", sim.Command)
	}
	for _, name := range kvmeshServices(c) {
		if m := c.Services[name].Environment["KVMESH_MODEL"]; m != sim.Command[i+1] {
			t.Errorf("%s runs model %q, the simulator plays %q", name, m, sim.Command[i+1])
		}
	}
}
