package helmtest_test

import (
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/kvmesh/kvmesh/deploy"
	"github.com/kvmesh/kvmesh/deploy/helmtest"
	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/adminapi"
	"github.com/kvmesh/kvmesh/pkg/auth"
	"github.com/kvmesh/kvmesh/pkg/config"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/httpserver"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/service"
)

// renderCase is one way of installing the chart and what it must yield.
type renderCase struct {
	name    string
	rel     helmtest.Release
	workers int  // gpuworker Deployments (engine ranks)
	secret  bool // the chart renders its Secret
	monitor bool // the chart renders a ServiceMonitor
	migrate bool // init containers migrate (else the scheduler does)
	admin   bool // KVMESH_ADMIN_TOKEN is set
	authOff bool // auth.mode=off: KVMESH_AUTH=off and no KVMESH_AUTH_KEY
	quotas  bool // the chart renders the quota hook Job
	// models is the KVMESH_MODELS of the lookup, the scheduler and the
	// sender (the values' models); empty: none.
	models string
	// tierSecret: the chart renders the tier's Secret; tierServer: the
	// tier's S3 server (a Deployment, a Service and a claim).
	tierSecret, tierServer bool
}

// testAuthKey is the auth.key of the renders that need one (the chart
// requires it with auth.mode=required, its default).
const testAuthKey = "helmtest-auth-key-0123456789abcdef"

// cases are the renders every check runs on.
var cases = []renderCase{
	{name: "default values", rel: helmtest.Release{Name: "kvmesh", Namespace: "kvmesh",
		Set: []string{"auth.key=" + testAuthKey}},
		workers: 2, secret: true, migrate: true},
	{name: "multi-engine values", rel: helmtest.Release{Name: "prod", Namespace: "inference",
		ValuesFiles: []string{"ci/multi-engine-values.yaml"}},
		workers: 6, secret: true, monitor: true, migrate: true, admin: true, quotas: true},
	{name: "existing secret, scheduler migrates", rel: helmtest.Release{Name: "kv", Namespace: "default",
		Set: []string{"existingSecret=kvmesh-credentials", "migrate.enabled=false", "serviceMonitor.enabled=true"}},
		workers: 2, monitor: true, admin: true},
	{name: "auth off, no key", rel: helmtest.Release{Name: "dev", Namespace: "dev",
		Set: []string{"auth.mode=off"}},
		workers: 2, secret: true, migrate: true, authOff: true},
	{name: "many models", rel: helmtest.Release{Name: "mm", Namespace: "models",
		ValuesFiles: []string{"ci/many-models-values.yaml"}},
		workers: 6, secret: true, migrate: true, models: "dense,full-swa-mamba"},
	{name: "tier with its server", rel: helmtest.Release{Name: "kvt", Namespace: "tiered",
		ValuesFiles: []string{"ci/tier-values.yaml"}},
		workers: 2, secret: true, monitor: true, migrate: true, tierSecret: true, tierServer: true},
	{name: "tier on an external bucket, existing secrets", rel: helmtest.Release{Name: "ext", Namespace: "infer",
		Set: []string{"existingSecret=kvmesh-credentials", "tier.enabled=true", "tier.url=https://s3.example.com/kv-cache/prod",
			"tier.existingSecret=s3-credentials"}},
		workers: 2, migrate: true, admin: true},
}

// tierComponent is the component label of the tier's S3 server's objects.
const tierComponent = "tier"

// isTierServer reports whether labels are those of the tier's S3 server,
// which runs no kvmesh program.
func isTierServer(labels map[string]string) bool {
	return labels["app.kubernetes.io/component"] == tierComponent && labels["app.kubernetes.io/name"] == "versitygw"
}

// render renders c, failing t on an error.
func render(t *testing.T, c renderCase) *helmtest.Manifests {
	t.Helper()
	m, err := helmtest.Render(testenv.ModuleRoot(t), c.rel)
	if err != nil {
		t.Fatalf("render: %v", err)
	}
	return m
}

// programs maps each kvmesh program to the package of its Config.
var programs = map[string]string{
	"lookup":    "services/lookup/internal/app",
	"scheduler": "services/scheduler/internal/app",
	"sender":    "services/sender/internal/app",
	"gpuworker": "services/gpuworker/internal/app",
}

// container is the kvmesh container of a Deployment, with its environment
// resolved as the kubelet would (Secret references from the render; an
// external Secret's value as a placeholder).
type container struct {
	deployment *appsv1.Deployment
	c          *corev1.Container
	program    string
	env        deploy.Environment
	refs       map[string]*corev1.SecretKeySelector
}

// containers returns the kvmesh container of every Deployment but the
// tier's S3 server (TestChartTier).
func containers(t *testing.T, m *helmtest.Manifests) []container {
	t.Helper()
	var out []container
	for i := range m.Deployments {
		d := &m.Deployments[i]
		if isTierServer(d.Labels) {
			continue
		}
		cs := d.Spec.Template.Spec.Containers
		if len(cs) != 1 {
			t.Errorf("%s: %d containers, want 1", d.Name, len(cs))
			continue
		}
		c := &cs[0]
		out = append(out, container{deployment: d, c: c, program: program(c), env: resolve(m, c), refs: secretRefs(c)})
	}
	return out
}

// program is the base name of the program a container runs.
func program(c *corev1.Container) string {
	if len(c.Command) == 0 {
		return ""
	}
	return path.Base(c.Command[0])
}

// resolve returns a container's environment.
func resolve(m *helmtest.Manifests, c *corev1.Container) deploy.Environment {
	env := deploy.Environment{}
	for _, e := range c.Env {
		switch ref := e.ValueFrom; {
		case ref == nil:
			env[e.Name] = e.Value
		case ref.SecretKeyRef != nil:
			v, ok := m.SecretValue(ref.SecretKeyRef.Name, ref.SecretKeyRef.Key)
			if !ok && m.Secret(ref.SecretKeyRef.Name) == nil {
				v = "from-secret-" + ref.SecretKeyRef.Name + "-" + ref.SecretKeyRef.Key
			}
			env[e.Name] = v
		}
	}
	return env
}

// secretRefs returns the Secret references of a container's environment.
func secretRefs(c *corev1.Container) map[string]*corev1.SecretKeySelector {
	out := map[string]*corev1.SecretKeySelector{}
	for _, e := range c.Env {
		if e.ValueFrom != nil && e.ValueFrom.SecretKeyRef != nil {
			out[e.Name] = e.ValueFrom.SecretKeyRef
		}
	}
	return out
}

// fieldsOf reads a program's Config settings from source.
func fieldsOf(t *testing.T, program string) []config.Field {
	t.Helper()
	dir, ok := programs[program]
	if !ok {
		t.Fatalf("%q is no kvmesh program", program)
	}
	fields, err := deploy.ConfigFields(testenv.ModuleRoot(t), dir, "Config")
	if err != nil {
		t.Fatal(err)
	}
	return fields
}

// checkEnv holds one container's environment to its program's Config: the
// variables it reads, required ones set, values that load, the shared
// settings valid (service.Common's Validate), no variable set twice and no
// loopback endpoint.
func checkEnv(t *testing.T, c container) []error {
	name := c.deployment.Name
	fields := fieldsOf(t, c.program)
	errs := deploy.CheckEnvironment(name, c.env, fields, deploy.ConfigPrototype(fields))
	if err := config.Load(&service.Common{}, func(k string) (string, bool) { v, ok := c.env[k]; return v, ok }); err != nil {
		errs = append(errs, fmt.Errorf("%s: shared settings: %w", name, err))
	}
	seen := map[string]bool{}
	for _, e := range c.c.Env {
		if seen[e.Name] {
			errs = append(errs, fmt.Errorf("%s: sets %s twice", name, e.Name))
		}
		seen[e.Name] = true
	}
	eps, err := deploy.Endpoints(c.env)
	if err != nil {
		errs = append(errs, fmt.Errorf("%s: %w", name, err))
	}
	for _, ep := range eps {
		if ip := net.ParseIP(ep.Host); ep.Host == "localhost" || ip != nil && ip.IsLoopback() {
			errs = append(errs, fmt.Errorf("%s: %s points at loopback %s: inside a pod that is the pod", name, ep.Var, ep.Host))
		}
	}
	return errs
}

// checkSecrets reports a Config secret (or a value carrying a password)
// set in plain env, and a Secret reference to a rendered Secret that lacks
// the key.
func checkSecrets(t *testing.T, m *helmtest.Manifests, c container) []error {
	name := c.deployment.Name
	var errs []error
	secret := map[string]bool{}
	for _, f := range fieldsOf(t, c.program) {
		secret[f.Env] = f.Secret
	}
	for _, e := range c.c.Env {
		if e.ValueFrom == nil && (secret[e.Name] || config.MaskPasswords(e.Value) != e.Value) {
			errs = append(errs, fmt.Errorf("%s: secret %s is set in plain env, want a secretKeyRef", name, e.Name))
		}
	}
	for env, ref := range c.refs {
		if m.Secret(ref.Name) == nil {
			continue // an existing Secret, outside the chart
		}
		if _, ok := m.SecretValue(ref.Name, ref.Key); !ok && (ref.Optional == nil || !*ref.Optional) {
			errs = append(errs, fmt.Errorf("%s: %s refers to key %s, which Secret %s lacks", name, env, ref.Key, ref.Name))
		}
	}
	return errs
}

func reportAll(t *testing.T, errs []error) {
	t.Helper()
	for _, err := range errs {
		t.Error(err)
	}
}

// TestChartRenders renders every case and counts its objects: the three
// singleton services and one Deployment and Service per gpuworker rank,
// the Secret, the ServiceMonitor and the quota Job when the values ask for
// them, every object named as a DNS label, unique within its kind.
func TestChartRenders(t *testing.T) {
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			m := render(t, c)
			server := map[bool]int{true: 1}[c.tierServer]
			if got, want := len(m.Deployments), 3+c.workers+server; got != want {
				t.Errorf("%d Deployments, want %d", got, want)
			}
			if got, want := len(m.Services), 3+c.workers+server; got != want {
				t.Errorf("%d Services, want %d", got, want)
			}
			if got, want := len(m.Claims), server; got != want {
				t.Errorf("%d PersistentVolumeClaims, want %d", got, want)
			}
			if got, want := len(m.Secrets), map[bool]int{true: 1}[c.secret]+map[bool]int{true: 1}[c.tierSecret]; got != want {
				t.Errorf("%d Secrets, want %d", got, want)
			}
			if got, want := len(m.ServiceMonitors), map[bool]int{true: 1}[c.monitor]; got != want {
				t.Errorf("%d ServiceMonitors, want %d", got, want)
			}
			if got, want := len(m.Jobs), map[bool]int{true: 1}[c.quotas]; got != want {
				t.Errorf("%d Jobs, want %d", got, want)
			}
			if !strings.Contains(m.Notes, c.rel.Namespace) {
				t.Errorf("NOTES.txt does not name the namespace:\n%s", m.Notes)
			}
			names := map[string]bool{}
			for _, d := range m.Deployments {
				names["Deployment/"+d.Name] = true
				if errs := validation.IsDNS1035Label(d.Name); len(errs) > 0 {
					t.Errorf("Deployment %s: %v", d.Name, errs)
				}
			}
			for _, s := range m.Services {
				if names["Service/"+s.Name] {
					t.Errorf("Service %s rendered twice", s.Name)
				}
				names["Service/"+s.Name] = true
				if errs := validation.IsDNS1035Label(s.Name); len(errs) > 0 {
					t.Errorf("Service %s: %v", s.Name, errs)
				}
			}
			if len(names) != len(m.Deployments)+len(m.Services) {
				t.Errorf("object names are not unique: %v", names)
			}
		})
	}
}

// TestChartEnvMatchesConfig holds every container's environment to the
// Config of the program it runs, as the compose test does.
func TestChartEnvMatchesConfig(t *testing.T) {
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			m := render(t, c)
			seen := map[string]int{}
			// KVMESH_MODEL is a gpuworker's engine's model: TestChartModels.
			shared := map[string]map[string]bool{"KVMESH_KEY_PREFIX": {}, "KVMESH_KAFKA_BROKERS": {}}
			for _, ct := range containers(t, m) {
				seen[ct.program]++
				reportAll(t, checkEnv(t, ct))
				for k := range shared {
					shared[k][ct.env[k]] = true
				}
				if _, ok := ct.env["KVMESH_ADMIN_TOKEN"]; ok != c.admin {
					t.Errorf("%s: KVMESH_ADMIN_TOKEN set %v, want %v", ct.deployment.Name, ok, c.admin)
				}
				reportAll(t, checkAuth(c, ct))
			}
			want := map[string]int{"lookup": 1, "scheduler": 1, "sender": 1, "gpuworker": c.workers}
			if fmt.Sprint(seen) != fmt.Sprint(want) {
				t.Errorf("programs %v, want %v", seen, want)
			}
			for k, vals := range shared {
				if len(vals) != 1 {
					t.Errorf("%s differs between services: %v", k, vals)
				}
			}
		})
	}
}

// modelSettings are the settings that decide the models a container
// serves.
var modelSettings = []string{"KVMESH_MODEL", "KVMESH_MODELS", "KVMESH_TP", "KVMESH_PCP", "KVMESH_DCP", "KVMESH_PP"}

// TestChartModels checks the models every container serves
// (checkModels) and pins the many-models values engine by engine.
func TestChartModels(t *testing.T) {
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			m := render(t, c)
			reportAll(t, checkModels(t, m, c.models))
			if c.name != "many models" {
				return
			}
			engines := map[string]string{}
			for _, ct := range containers(t, m) {
				if ct.program == "gpuworker" {
					engines[ct.env["KVMESH_ENGINE_ID"]] = ct.env["KVMESH_MODEL"]
				}
			}
			want := map[string]string{"hybrid-0": "hybrid-mla-linear", "hybrid-1": "hybrid-mla-linear",
				"dense-0": "dense", "swa-0": "full-swa-mamba"}
			if !maps.Equal(engines, want) {
				t.Errorf("engines' models %v, want %v", engines, want)
			}
		})
	}
}

// checkModels reports how the models the containers of m serve disagree:
// the lookup, the scheduler and the sender must have the same
// KVMESH_MODEL, parallel overrides and KVMESH_MODELS (want, the values'
// models); a gpuworker serves its engine's model alone, never with
// KVMESH_MODELS, and a model the services serve with the same fingerprint
// (so the parallel overrides only for the default model: another runs at
// its spec's layout, as the services serve it).
func checkModels(t *testing.T, m *helmtest.Manifests, want string) []error {
	t.Helper()
	var errs []error
	var served *kvcore.Models
	var svc map[string]string // the first service's model settings
	for _, ct := range containers(t, m) {
		if ct.program == "gpuworker" {
			continue
		}
		name := ct.deployment.Name
		got := map[string]string{}
		for _, k := range modelSettings {
			if v, ok := ct.env[k]; ok {
				got[k] = v
			}
		}
		if got["KVMESH_MODELS"] != want {
			errs = append(errs, fmt.Errorf("%s: KVMESH_MODELS %q, want %q", name, got["KVMESH_MODELS"], want))
		}
		if svc != nil {
			if !maps.Equal(got, svc) {
				errs = append(errs, fmt.Errorf("%s serves %v, another service %v", name, got, svc))
			}
			continue
		}
		svc = got
		common, err := loadCommon(ct.env)
		if err == nil {
			served, err = common.LoadModels()
		}
		if err != nil {
			return append(errs, fmt.Errorf("%s: its models do not load: %w", name, err))
		}
	}
	if served == nil {
		return append(errs, errors.New("no lookup, scheduler or sender"))
	}
	for _, ct := range containers(t, m) {
		if ct.program != "gpuworker" {
			continue
		}
		name := ct.deployment.Name
		if v, ok := ct.env["KVMESH_MODELS"]; ok {
			errs = append(errs, fmt.Errorf("%s: KVMESH_MODELS %q on a gpuworker, which serves its engine's model alone", name, v))
		}
		common, err := loadCommon(ct.env)
		var own *kvcore.Model
		if err == nil {
			own, err = common.LoadModel()
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: model %q does not load: %w", name, ct.env["KVMESH_MODEL"], err))
			continue
		}
		switch sm, err := served.Get(own.Name); {
		case err != nil:
			errs = append(errs, fmt.Errorf("%s: runs %q, which the services do not serve: %w", name, ct.env["KVMESH_MODEL"], err))
		case own.Fingerprint() != sm.Fingerprint():
			errs = append(errs, fmt.Errorf("%s: runs %s with fingerprint %s (parallel %+v), the services serve it with %s (parallel %+v)",
				name, own.Name, own.Fingerprint(), own.Parallel, sm.Fingerprint(), sm.Parallel))
		}
	}
	return errs
}

// TestChartModelChecksCatchDrift renders values that break the models'
// rules past the chart (through each service's env) and checks that
// checkModels reports each one: it can fail.
func TestChartModelChecksCatchDrift(t *testing.T) {
	tests := []struct {
		name   string
		set    []string
		models string // the values' models, as KVMESH_MODELS
		want   string
	}{
		{"KVMESH_MODELS on a gpuworker", []string{"models={dense}", "gpuworker.env.KVMESH_MODELS=dense"}, "dense",
			"KVMESH_MODELS \"dense\" on a gpuworker"},
		{"the parallel overrides on another model's gpuworker", []string{"models={dense}", "parallel.tp=2",
			"gpuworker.engines[0].id=a", "gpuworker.engines[0].model=dense", "gpuworker.engines[0].env.KVMESH_TP=2"}, "dense",
			"runs dense-8b with fingerprint"},
		{"a gpuworker of a model not served", []string{"gpuworker.env.KVMESH_MODEL=dense"}, "", "which the services do not serve"},
		{"a service with other models", []string{"models={dense}", "sender.env.KVMESH_MODELS=full-swa-mamba"}, "dense", "serves map"},
		{"a service with another default", []string{"scheduler.env.KVMESH_TP=2"}, "", "serves map"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			set := append([]string{"auth.key=" + testAuthKey}, tt.set...)
			m, err := helmtest.Render(testenv.ModuleRoot(t), helmtest.Release{Name: "kvmesh", Namespace: "kvmesh", Set: set})
			if err != nil {
				t.Fatal(err)
			}
			errs := checkModels(t, m, tt.models)
			if !slices.ContainsFunc(errs, func(err error) bool { return strings.Contains(err.Error(), tt.want) }) {
				t.Errorf("errors %v, want one saying %q", errors.Join(errs...), tt.want)
			}
		})
	}
}

// loadCommon reads the shared settings from env.
func loadCommon(env deploy.Environment) (*service.Common, error) {
	var c service.Common
	if err := config.Load(&c, func(k string) (string, bool) { v, ok := env[k]; return v, ok }); err != nil {
		return nil, fmt.Errorf("shared settings: %w", err)
	}
	return &c, nil
}

// checkAuth reports how a container's authentication settings disagree
// with its render case: KVMESH_AUTH set explicitly (whatever the code's
// default) to required or off, and, when required, KVMESH_AUTH_KEY from
// the release's Secret (a reference that must resolve: not optional), a
// key of at least auth.MinKeyBytes bytes; no key at all when off.
func checkAuth(c renderCase, ct container) []error {
	name := ct.deployment.Name
	want := auth.ModeRequired
	if c.authOff {
		want = auth.ModeOff
	}
	var errs []error
	if got, ok := ct.env["KVMESH_AUTH"]; !ok || got != want {
		errs = append(errs, fmt.Errorf("%s: KVMESH_AUTH %q (set %v), want %q", name, got, ok, want))
	}
	key, ok := ct.env["KVMESH_AUTH_KEY"]
	ref := ct.refs["KVMESH_AUTH_KEY"]
	switch {
	case c.authOff && ok:
		errs = append(errs, fmt.Errorf("%s: KVMESH_AUTH_KEY is set with auth.mode=off", name))
	case c.authOff:
	case ref == nil:
		errs = append(errs, fmt.Errorf("%s: KVMESH_AUTH_KEY is not read from a Secret", name))
	case ref.Key != "KVMESH_AUTH_KEY" || ref.Optional != nil && *ref.Optional:
		errs = append(errs, fmt.Errorf("%s: KVMESH_AUTH_KEY from key %s (optional %v), want the required key KVMESH_AUTH_KEY",
			name, ref.Key, ref.Optional != nil && *ref.Optional))
	case len(key) < auth.MinKeyBytes:
		errs = append(errs, fmt.Errorf("%s: KVMESH_AUTH_KEY is %d bytes, want at least %d", name, len(key), auth.MinKeyBytes))
	}
	return errs
}

// TestChartSecrets checks that credentials come from the Secret only: no
// Config secret and no URL password in plain env, and the rendered Secret
// holds every key referred to.
func TestChartSecrets(t *testing.T) {
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			m := render(t, c)
			refs := 0
			for _, ct := range containers(t, m) {
				reportAll(t, checkSecrets(t, m, ct))
				refs += len(ct.refs)
				for _, ic := range ct.deployment.Spec.Template.Spec.InitContainers {
					for _, e := range ic.Env {
						if e.ValueFrom == nil && config.MaskPasswords(e.Value) != e.Value {
							t.Errorf("%s/%s: %s carries a password in plain env", ct.deployment.Name, ic.Name, e.Name)
						}
					}
				}
			}
			if refs == 0 {
				t.Error("no container reads a Secret")
			}
			if c.secret {
				s := m.Secret(senderContainer(t, m).refs["KVMESH_REDIS_URL"].Name)
				if s == nil {
					t.Fatal("the services' KVMESH_REDIS_URL is not from the chart's Secret")
				}
				for _, k := range []string{"KVMESH_DATABASE_URL", "KVMESH_REDIS_URL"} {
					if v, ok := m.SecretValue(s.Name, k); !ok || v == "" {
						t.Errorf("Secret %s: no %s", s.Name, k)
					}
				}
				if _, ok := m.SecretValue(s.Name, "KVMESH_ADMIN_TOKEN"); ok != c.admin {
					t.Errorf("Secret %s: KVMESH_ADMIN_TOKEN present %v, want %v", s.Name, ok, c.admin)
				}
				if _, ok := m.SecretValue(s.Name, "KVMESH_AUTH_KEY"); ok == c.authOff {
					t.Errorf("Secret %s: KVMESH_AUTH_KEY present %v, want %v", s.Name, ok, !c.authOff)
				}
			}
		})
	}
}

// TestChartPortsAndProbes checks each container listens on its program's
// contract port (KVMESH_HTTP_ADDR and the container port), is probed for
// liveness on /healthz and readiness on /readyz there, and is reached
// through a Service on that port that selects its pods alone.
func TestChartPortsAndProbes(t *testing.T) {
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			m := render(t, c)
			zmq := 0
			for _, ct := range containers(t, m) {
				reportAll(t, checkPorts(m, ct))
				zmq += len(zmqPort(ct))
			}
			// The multi-engine values turn the lookup's ZMQ publisher on
			// (lookup.kvEventsZMQ) on both replicas' one Deployment.
			if want := map[string]int{"multi-engine values": 1}[c.name]; zmq != want {
				t.Errorf("%d containers with the ZMQ publisher, want %d", zmq, want)
			}
		})
	}
}

// checkPorts reports how a container's port, probes and Service disagree
// with its program's contract address.
func checkPorts(m *helmtest.Manifests, ct container) []error {
	name := ct.deployment.Name
	_, want, err := net.SplitHostPort(deploy.ServiceAddrs[ct.program])
	if err != nil {
		return []error{fmt.Errorf("%s: %q has no contract address: %w", name, ct.program, err)}
	}
	var errs []error
	if _, p, _ := net.SplitHostPort(ct.env["KVMESH_HTTP_ADDR"]); p != want {
		errs = append(errs, fmt.Errorf("%s: KVMESH_HTTP_ADDR %q, want port %s", name, ct.env["KVMESH_HTTP_ADDR"], want))
	}
	extra := zmqPort(ct)
	if len(ct.c.Ports) != 1+len(extra) || fmt.Sprint(ct.c.Ports[0].ContainerPort) != want {
		return append(errs, fmt.Errorf("%s: container ports %v, want %s and %v", name, ct.c.Ports, want, extra))
	}
	for i, p := range extra {
		if got := ct.c.Ports[1+i]; got.Name != "kv-events" || fmt.Sprint(got.ContainerPort) != p {
			errs = append(errs, fmt.Errorf("%s: container port %+v, want kv-events on %s (KVMESH_LOOKUP_KV_EVENTS_ZMQ_ENDPOINT)", name, got, p))
		}
	}
	port := ct.c.Ports[0]
	probes := []struct {
		kind  string
		probe *corev1.Probe
		path  string
	}{
		{"liveness", ct.c.LivenessProbe, httpserver.PathHealth},
		{"readiness", ct.c.ReadinessProbe, httpserver.PathReady},
		{"startup", ct.c.StartupProbe, httpserver.PathHealth},
	}
	for _, p := range probes {
		if p.probe == nil || p.probe.HTTPGet == nil {
			errs = append(errs, fmt.Errorf("%s: no HTTP %s probe", name, p.kind))
			continue
		}
		g := p.probe.HTTPGet
		if g.Path != p.path || (g.Port.StrVal != port.Name && fmt.Sprint(g.Port.IntVal) != want) {
			errs = append(errs, fmt.Errorf("%s: %s probe GET %s on port %s, want %s on %s", name, p.kind, g.Path, g.Port.String(), p.path, want))
		}
	}
	pods := labels.Set(ct.deployment.Spec.Template.Labels)
	var svcs []string
	for _, s := range m.Services {
		if len(s.Spec.Selector) == 0 || !labels.SelectorFromSet(s.Spec.Selector).Matches(pods) {
			continue
		}
		svcs = append(svcs, s.Name)
		if len(s.Spec.Ports) != 1+len(extra) || fmt.Sprint(s.Spec.Ports[0].Port) != want ||
			s.Spec.Ports[0].TargetPort.String() != port.Name && s.Spec.Ports[0].TargetPort.String() != want {
			errs = append(errs, fmt.Errorf("%s: Service %s ports %v, want %s to the container's", name, s.Name, s.Spec.Ports, want))
			continue
		}
		for i, p := range extra {
			if sp := s.Spec.Ports[1+i]; fmt.Sprint(sp.Port) != p || sp.TargetPort.String() != "kv-events" {
				errs = append(errs, fmt.Errorf("%s: Service %s port %+v, want %s to the container's kv-events", name, s.Name, sp, p))
			}
		}
	}
	if len(svcs) != 1 || svcs[0] != name {
		errs = append(errs, fmt.Errorf("%s: selected by Services %v, want its own only", name, svcs))
	}
	if sel := ct.deployment.Spec.Selector; sel == nil || !labels.SelectorFromSet(sel.MatchLabels).Matches(pods) {
		errs = append(errs, fmt.Errorf("%s: its selector does not match its pods", name))
	}
	return errs
}

// zmqPort is the port of the lookup's ZMQ publisher, from its
// KVMESH_LOOKUP_KV_EVENTS_ZMQ_ENDPOINT, as the only element of a list;
// empty for a container without one.
func zmqPort(ct container) []string {
	ep, ok := strings.CutPrefix(ct.env["KVMESH_LOOKUP_KV_EVENTS_ZMQ_ENDPOINT"], "tcp://")
	if !ok {
		return nil
	}
	_, p, _ := net.SplitHostPort(ep)
	return []string{p}
}

// rank is a gpuworker's identity: engine id and its four rank indices.
func rank(env deploy.Environment) string {
	return fmt.Sprintf("%s tp=%s pcp=%s dcp=%s pp=%s", env["KVMESH_ENGINE_ID"],
		env["KVMESH_RANK_TP"], env["KVMESH_RANK_PCP"], env["KVMESH_RANK_DCP"], env["KVMESH_RANK_PP"])
}

// TestChartGPUWorkers checks the per-engine set: every gpuworker a single
// pod, replaced (never rolled) so no two run at once, with a distinct
// engine id and rank, and a data-plane URL at its own Service's port.
func TestChartGPUWorkers(t *testing.T) {
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			m := render(t, c)
			ranks := map[string]string{}
			for _, ct := range containers(t, m) {
				if ct.program != "gpuworker" {
					continue
				}
				d := ct.deployment
				if d.Spec.Replicas == nil || *d.Spec.Replicas != 1 || d.Spec.Strategy.Type != appsv1.RecreateDeploymentStrategyType {
					t.Errorf("%s: replicas %v strategy %q, want 1 and Recreate", d.Name, d.Spec.Replicas, d.Spec.Strategy.Type)
				}
				for _, k := range []string{"KVMESH_ENGINE_ID", "KVMESH_RANK_TP", "KVMESH_RANK_PCP", "KVMESH_RANK_DCP", "KVMESH_RANK_PP"} {
					if ct.env[k] == "" {
						t.Errorf("%s: %s is not set", d.Name, k)
					}
				}
				r := rank(ct.env)
				if other, dup := ranks[r]; dup {
					t.Errorf("%s and %s are both %s", other, d.Name, r)
				}
				ranks[r] = d.Name
				_, port, _ := net.SplitHostPort(contract.GPUWorkerAddr)
				if want := fmt.Sprintf("http://%s.%s.svc:%s", d.Name, m.Namespace, port); ct.env["KVMESH_DATAPLANE_URL"] != want {
					t.Errorf("%s: KVMESH_DATAPLANE_URL %q, want %q (its Service)", d.Name, ct.env["KVMESH_DATAPLANE_URL"], want)
				}
			}
			if len(ranks) != c.workers {
				t.Errorf("%d distinct gpuworker ranks %v, want %d", len(ranks), ranks, c.workers)
			}
		})
	}
}

// TestChartMultiEngineRanks pins the ranks of the multi-engine values
// file, so a template that drops a rank field fails.
func TestChartMultiEngineRanks(t *testing.T) {
	m := render(t, cases[1])
	var got []string
	for _, ct := range containers(t, m) {
		if ct.program == "gpuworker" {
			got = append(got, rank(ct.env)+" blocks="+ct.env["KVMESH_POOL_BLOCKS"])
		}
	}
	slices.Sort(got)
	want := []string{
		"decode-0 tp=0 pcp=0 dcp=0 pp=0 blocks=",
		"decode-0 tp=1 pcp=0 dcp=0 pp=0 blocks=",
		"decode-1 tp=0 pcp=0 dcp=0 pp=0 blocks=",
		"decode-1 tp=1 pcp=0 dcp=0 pp=0 blocks=",
		"prefill-0 tp=0 pcp=0 dcp=0 pp=0 blocks=4096",
		"prefill-0 tp=1 pcp=0 dcp=0 pp=0 blocks=4096",
	}
	if !slices.Equal(got, want) {
		t.Errorf("gpuworkers\n%s\nwant\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	for _, ct := range containers(t, m) {
		if tp := ct.env["KVMESH_TP"]; tp != "2" {
			t.Errorf("%s: KVMESH_TP %q, want the values' parallel.tp 2 in every service", ct.deployment.Name, tp)
		}
	}
}

// TestChartServiceMonitor checks the ServiceMonitor selects every Service
// of the release, in its namespace, and scrapes /metrics on their port.
func TestChartServiceMonitor(t *testing.T) {
	for _, c := range cases {
		if !c.monitor {
			continue
		}
		t.Run(c.name, func(t *testing.T) {
			m := render(t, c)
			sm := m.ServiceMonitors[0]
			if !slices.Equal(sm.Spec.NamespaceSelector.MatchNames, []string{m.Namespace}) {
				t.Errorf("namespaces %v, want [%s]", sm.Spec.NamespaceSelector.MatchNames, m.Namespace)
			}
			if len(sm.Spec.Endpoints) != 1 {
				t.Fatalf("endpoints %v, want one", sm.Spec.Endpoints)
			}
			ep := sm.Spec.Endpoints[0]
			if ep.Path != httpserver.PathMetrics {
				t.Errorf("scrapes %q, want %s", ep.Path, httpserver.PathMetrics)
			}
			if len(sm.Spec.Selector.MatchLabels) == 0 {
				t.Fatal("the selector selects nothing by label")
			}
			sel := labels.SelectorFromSet(sm.Spec.Selector.MatchLabels)
			for _, s := range m.Services {
				if isTierServer(s.Labels) {
					// versitygw serves no Prometheus /metrics.
					if sel.Matches(labels.Set(s.Labels)) {
						t.Errorf("selects the tier server's Service %s", s.Name)
					}
					continue
				}
				if !sel.Matches(labels.Set(s.Labels)) {
					t.Errorf("does not select Service %s (labels %v)", s.Name, s.Labels)
				}
				if !slices.ContainsFunc(s.Spec.Ports, func(p corev1.ServicePort) bool { return p.Name == ep.Port }) {
					t.Errorf("Service %s has no port %q", s.Name, ep.Port)
				}
			}
		})
	}
}

// TestChartMigrates checks the schema is migrated before a service uses
// it: with migrate on, every pod that reads KVMESH_DATABASE_URL first runs
// `kvmesh migrate` with only that variable, from the Secret, and the
// scheduler does not migrate; with it off the scheduler does.
func TestChartMigrates(t *testing.T) {
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			m := render(t, c)
			for _, ct := range containers(t, m) {
				d := ct.deployment
				inits := d.Spec.Template.Spec.InitContainers
				_, usesDB := ct.env["KVMESH_DATABASE_URL"]
				if ct.program == "scheduler" && ct.env["KVMESH_MIGRATE"] != fmt.Sprint(!c.migrate) {
					t.Errorf("%s: KVMESH_MIGRATE %q, want %v", d.Name, ct.env["KVMESH_MIGRATE"], !c.migrate)
				}
				if !usesDB || !c.migrate {
					if len(inits) != 0 {
						t.Errorf("%s: init containers %d, want none", d.Name, len(inits))
					}
					continue
				}
				if len(inits) != 1 || !slices.Equal(inits[0].Command, []string{"/usr/local/bin/kvmesh", "migrate"}) {
					t.Errorf("%s: init containers %v, want one running kvmesh migrate", d.Name, inits)
					continue
				}
				env := inits[0].Env
				if len(env) != 1 || env[0].Name != "KVMESH_DATABASE_URL" || env[0].ValueFrom == nil ||
					*env[0].ValueFrom.SecretKeyRef != *ct.refs["KVMESH_DATABASE_URL"] {
					t.Errorf("%s: migrate env %v, want KVMESH_DATABASE_URL from the service's Secret", d.Name, env)
				}
				if inits[0].Image != ct.c.Image {
					t.Errorf("%s: migrate image %s, want the service's %s", d.Name, inits[0].Image, ct.c.Image)
				}
			}
		})
	}
}

// TestChartSecurity checks every pod runs as a non-root user without
// privilege escalation, all capabilities dropped, a read-only root file
// system and no service-account token, and every container has resources.
func TestChartSecurity(t *testing.T) {
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			m := render(t, c)
			for _, d := range m.Deployments {
				spec := d.Spec.Template.Spec
				psc := spec.SecurityContext
				if psc == nil || psc.RunAsNonRoot == nil || !*psc.RunAsNonRoot || psc.RunAsUser == nil || *psc.RunAsUser == 0 {
					t.Errorf("%s: pod security context %+v, want a non-root user", d.Name, psc)
				}
				if spec.AutomountServiceAccountToken == nil || *spec.AutomountServiceAccountToken {
					t.Errorf("%s: mounts a service-account token", d.Name)
				}
				for _, ctr := range append(slices.Clone(spec.InitContainers), spec.Containers...) {
					if err := checkContainerSecurity(ctr); err != nil {
						t.Errorf("%s/%s: %v", d.Name, ctr.Name, err)
					}
				}
				if r := spec.Containers[0].Resources; len(r.Requests) == 0 || len(r.Limits) == 0 {
					t.Errorf("%s: resources %+v, want requests and limits", d.Name, r)
				}
			}
		})
	}
}

// checkContainerSecurity reports a container that may escalate its
// privileges, write its root file system, keep a capability or run as root.
func checkContainerSecurity(ctr corev1.Container) error {
	sc := ctr.SecurityContext
	switch {
	case sc == nil:
		return errors.New("no security context")
	case sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation:
		return errors.New("allows privilege escalation")
	case sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem:
		return errors.New("writable root file system")
	case sc.Capabilities == nil || !slices.Contains(sc.Capabilities.Drop, "ALL"):
		return fmt.Errorf("capabilities %+v, want ALL dropped", sc.Capabilities)
	case sc.RunAsUser != nil && *sc.RunAsUser == 0:
		return errors.New("runs as root")
	}
	return nil
}

// TestChartImage checks every container runs, from the values' image, a
// program the Dockerfile builds into /usr/local/bin.
func TestChartImage(t *testing.T) {
	root := testenv.ModuleRoot(t)
	df, err := os.ReadFile(filepath.Join(root, deploy.Dockerfile))
	if err != nil {
		t.Fatal(err)
	}
	built := map[string]bool{}
	for _, line := range strings.Split(string(df), "\n") {
		for _, f := range strings.Fields(line) {
			if strings.HasPrefix(f, "./cmd/") || strings.HasPrefix(f, "./services/") {
				built[path.Base(f)] = true
			}
		}
	}
	if !strings.Contains(string(df), "COPY --from=build /out/ /usr/local/bin/") || len(built) < 5 {
		t.Fatalf("the Dockerfile no longer builds the programs into /usr/local/bin (found %v)", built)
	}
	wantImage := map[string]string{"default values": "kvmesh:0.1.0", "multi-engine values": "registry.example.com/kvmesh:1.2.3"}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			m := render(t, c)
			for _, d := range m.Deployments {
				if isTierServer(d.Labels) {
					continue // versitygw's own image: TestChartTier
				}
				spec := d.Spec.Template.Spec
				for _, ctr := range append(slices.Clone(spec.InitContainers), spec.Containers...) {
					if len(ctr.Command) == 0 || path.Dir(ctr.Command[0]) != "/usr/local/bin" || !built[path.Base(ctr.Command[0])] {
						t.Errorf("%s/%s: runs %q, which the Dockerfile does not build into /usr/local/bin", d.Name, ctr.Name, ctr.Command)
					}
					if w, ok := wantImage[c.name]; ok && ctr.Image != w {
						t.Errorf("%s/%s: image %s, want %s", d.Name, ctr.Name, ctr.Image, w)
					}
					if ctr.Image != spec.Containers[0].Image {
						t.Errorf("%s/%s: image %s, want the one image of the mesh", d.Name, ctr.Name, ctr.Image)
					}
				}
			}
		})
	}
}

// TestChartTLS checks HTTPS between the services: with tls.secretName,
// every kvmesh container mounts that Secret read-only and points
// KVMESH_HTTP_TLS_CERT_FILE, KVMESH_HTTP_TLS_KEY_FILE and (with
// tls.verifyCA) KVMESH_HTTP_CA_FILE at its files, the kubelet probes over
// HTTPS, the gpuworkers register https:// data-plane URLs, and every
// variable is one the program's Config reads; without it, none of that.
// (TestChartEnvMatchesConfig's full load cannot run here: it would read
// the certificate files.)
func TestChartTLS(t *testing.T) {
	tests := []struct {
		name   string
		set    []string
		dir    string // mount path; empty: no TLS
		secret string
		ca     bool
	}{
		{name: "off", set: nil},
		{name: "secret with a CA", set: []string{"tls.secretName=kvmesh-tls"},
			dir: "/etc/kvmesh/tls", secret: "kvmesh-tls", ca: true},
		{name: "system roots, own mount path", set: []string{"tls.secretName=certs", "tls.verifyCA=false", "tls.mountPath=/certs/"},
			dir: "/certs", secret: "certs"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			rel := helmtest.Release{Name: "kvmesh", Namespace: "kvmesh", Set: append([]string{"auth.key=" + testAuthKey}, tt.set...)}
			m, err := helmtest.Render(testenv.ModuleRoot(t), rel)
			if err != nil {
				t.Fatal(err)
			}
			scheme := map[bool]corev1.URIScheme{false: corev1.URISchemeHTTP, true: corev1.URISchemeHTTPS}[tt.dir != ""]
			for _, ct := range containers(t, m) {
				name := ct.deployment.Name
				fields := fieldsOf(t, ct.program)
				reportAll(t, deploy.CheckEnvironment(name, ct.env, fields, deploy.ConfigPrototype(fields)))
				reportAll(t, checkPorts(m, ct))
				want := map[string]string{}
				if tt.dir != "" {
					want["KVMESH_HTTP_TLS_CERT_FILE"] = tt.dir + "/tls.crt"
					want["KVMESH_HTTP_TLS_KEY_FILE"] = tt.dir + "/tls.key"
					if tt.ca {
						want["KVMESH_HTTP_CA_FILE"] = tt.dir + "/ca.crt"
					}
				}
				for _, k := range []string{"KVMESH_HTTP_TLS_CERT_FILE", "KVMESH_HTTP_TLS_KEY_FILE", "KVMESH_HTTP_CA_FILE",
					"KVMESH_HTTP_TLS_CLIENT_CA_FILE", "KVMESH_HTTP_CLIENT_CERT_FILE", "KVMESH_HTTP_CLIENT_KEY_FILE"} {
					if got, ok := ct.env[k]; got != want[k] || ok != (want[k] != "") {
						t.Errorf("%s: %s %q (set %v), want %q", name, k, got, ok, want[k])
					}
				}
				if got := tlsMount(ct); got != tt.dir+"|"+tt.secret && !(tt.dir == "" && got == "") {
					t.Errorf("%s: TLS mount %q, want %q", name, got, tt.dir+"|"+tt.secret)
				}
				for _, p := range []*corev1.Probe{ct.c.StartupProbe, ct.c.LivenessProbe, ct.c.ReadinessProbe} {
					if p == nil || p.HTTPGet == nil {
						t.Errorf("%s: a probe is not an HTTP GET", name)
					} else if p.HTTPGet.Scheme != scheme {
						t.Errorf("%s: probe of %s over %q, want %s", name, p.HTTPGet.Path, p.HTTPGet.Scheme, scheme)
					}
				}
				if u := ct.env["KVMESH_DATAPLANE_URL"]; ct.program == "gpuworker" && !strings.HasPrefix(u, strings.ToLower(string(scheme))+"://") {
					t.Errorf("%s: KVMESH_DATAPLANE_URL %q, want %s", name, u, strings.ToLower(string(scheme)))
				}
			}
			if want := strings.ToLower(string(scheme)) + "://"; !strings.Contains(m.Notes, want) {
				t.Errorf("NOTES.txt names no %s URL:\n%s", want, m.Notes)
			}
		})
	}
}

// tlsMount is "mount path|Secret" of the read-only Secret volume (mode
// 0440) a container mounts besides /tmp, empty when there is none.
func tlsMount(ct container) string {
	var out []string
	for _, vm := range ct.c.VolumeMounts {
		if vm.MountPath == "/tmp" {
			continue
		}
		for _, v := range ct.deployment.Spec.Template.Spec.Volumes {
			if v.Name != vm.Name {
				continue
			}
			switch {
			case v.Secret == nil || !vm.ReadOnly:
				out = append(out, vm.MountPath+"|not a read-only Secret")
			case v.Secret.DefaultMode == nil || *v.Secret.DefaultMode != 0o440:
				out = append(out, fmt.Sprintf("%s|%s mode %v, want 0440 (the pod's group only)", vm.MountPath, v.Secret.SecretName, v.Secret.DefaultMode))
			default:
				out = append(out, vm.MountPath+"|"+v.Secret.SecretName)
			}
		}
	}
	return strings.Join(out, ", ")
}

// TestChartRejectsBadValues checks the chart refuses values that would
// deploy a broken mesh, rather than rendering them.
func TestChartRejectsBadValues(t *testing.T) {
	tests := []struct {
		name string
		set  []string
		want string
	}{
		{"duplicate engine", []string{"gpuworker.engines[0].id=a", "gpuworker.engines[1].id=a"}, "listed twice"},
		{"engine id not a DNS label", []string{"gpuworker.engines[0].id=Decode_0"}, "not a DNS label"},
		{"duplicate rank", []string{"gpuworker.engines[0].id=a", "gpuworker.engines[0].ranks[0].tp=1", "gpuworker.engines[0].ranks[1].tp=1"}, "twice"},
		{"no brokers", []string{"kafka.brokers=null"}, "kafka.brokers"},
		{"an unknown event form", []string{"kvEventsForm=list"}, `kvEventsForm: "list" is not map or array`},
		{"no database", []string{"postgres.url="}, "postgres.url is required"},
		{"no engines", []string{"gpuworker.engines=null"}, "gpuworker.engines"},
		{"auth required without a key", []string{"auth.key="},
			"auth.key is required with auth.mode=required: set it to a random key of at least 32 bytes"},
		{"auth required by default without a key", []string{"auth.mode=", "auth.key="}, "auth.key is required"},
		{"a short auth key", []string{"auth.key=0123456789abcdef"}, "auth.key is 16 bytes: it must be at least 32"},
		{"an unknown auth mode", []string{"auth.mode=optional"}, `auth.mode: "optional" is neither required nor off`},
		{"quotas without the operator token", []string{"quotas[0].tenant=a", "quotas[0].maxKeys=1"},
			"quotas: setting them needs the operator token: set adminToken, or existingSecret"},
		{"a quota without a tenant", []string{"adminToken=t", "quotas[0].maxKeys=1"}, "quotas[0].tenant is required"},
		{"a quota's tenant that is none", []string{"adminToken=t", "quotas[0].tenant=a b", "quotas[0].maxKeys=1"},
			`quotas[0]: tenant "a b" is not 1 to 64 of [A-Za-z0-9._-]`},
		{"a tenant listed twice", []string{"adminToken=t", "quotas[0].tenant=a", "quotas[0].maxKeys=1", "quotas[1].tenant=a", "quotas[1].maxKeys=2"},
			`quotas: tenant "a" is listed twice`},
		{"a quota without a bound", []string{"adminToken=t", "quotas[0].tenant=a", "quotas[0].onFull=skip", "quotas[0].maxBytes=0"},
			`quotas[0] (tenant "a"): set maxBytes or maxKeys (or both)`},
		{"a quota's unknown onFull", []string{"adminToken=t", "quotas[0].tenant=a", "quotas[0].maxKeys=1", "quotas[0].onFull=drop"},
			`onFull "drop" is neither evict nor skip`},
		{"a quota's unknown key", []string{"adminToken=t", "quotas[0].tenant=a", "quotas[0].maxbytes=1GiB"},
			`quotas[0]: unknown key "maxbytes"`},
		{"an engine of a model not served", []string{"gpuworker.engines[0].id=a", "gpuworker.engines[0].model=dense"},
			`engine "a" runs model "dense", which is neither model nor one of models`},
		{"an engine of a model not served beside others", []string{"models={full-swa-mamba}",
			"gpuworker.engines[0].id=a", "gpuworker.engines[0].model=full-swa-mamba", "gpuworker.engines[1].id=b", "gpuworker.engines[1].model=dense"},
			`engine "b" runs model "dense", which is neither model nor one of models`},
		{"models listing model", []string{"models={dense,hybrid-mla-linear}"},
			`models[1]: "hybrid-mla-linear" is model already`},
		{"a model listed twice", []string{"models={dense,dense}"}, `models: "dense" is listed twice`},
		{"a model with a blank", []string{"models[0]=my model.yaml"}, `models[0]: "my model.yaml" is not a preset name or a spec file path`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			// A valid key first, so that each case fails for its own reason.
			set := append([]string{"auth.key=" + testAuthKey}, tt.set...)
			_, err := helmtest.Render(testenv.ModuleRoot(t), helmtest.Release{Name: "kvmesh", Namespace: "kvmesh", Set: set})
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("render error %v, want one saying %q", err, tt.want)
			}
		})
	}
}

// TestChartChecksCatchDrift renders values that break the contract and
// checks that the checks above report each one: they can fail.
func TestChartChecksCatchDrift(t *testing.T) {
	tests := []struct {
		name    string
		set     []string
		program string
		check   func(*testing.T, *helmtest.Manifests, container) []error
		want    string
	}{
		{"a variable no Config reads", []string{"lookup.env.KVMESH_NO_SUCH_SETTING=1"}, "lookup",
			envCheck, "does not read"},
		{"a gpuworker setting on the sender", []string{"sender.env.KVMESH_POOL_BLOCKS=8"}, "sender",
			envCheck, "KVMESH_POOL_BLOCKS, which its Config does not read"},
		{"a value that does not parse", []string{"scheduler.env.KVMESH_SCHEDULER_CONSUMERS=many"}, "scheduler",
			envCheck, "does not load"},
		{"a bad shared setting", []string{"logLevel=loud"}, "lookup", envCheck, "KVMESH_LOG_LEVEL"},
		{"a variable set twice", []string{"sender.env.KVMESH_HTTP_ADDR=:8083"}, "sender", envCheck, "twice"},
		{"a loopback broker", []string{"kafka.brokers[0]=127.0.0.1:9092"}, "lookup", envCheck, "loopback"},
		{"a secret in plain env", []string{"lookup.env.KVMESH_ADMIN_TOKEN=hunter2"}, "lookup",
			secretCheck, "KVMESH_ADMIN_TOKEN is set in plain env"},
		{"an auth key in plain env", []string{"lookup.env.KVMESH_AUTH_KEY=" + testAuthKey}, "lookup",
			secretCheck, "KVMESH_AUTH_KEY is set in plain env"},
		{"auth off where required", []string{"auth.mode=off"}, "sender",
			authCheck(renderCase{}), `KVMESH_AUTH "off"`},
		{"an auth key where auth is off", nil, "sender",
			authCheck(renderCase{authOff: true}), "KVMESH_AUTH_KEY is set with auth.mode=off"},
		{"an auth key from plain env", []string{"existingSecret=x", "scheduler.env.KVMESH_AUTH_KEY=" + testAuthKey}, "scheduler",
			authCheck(renderCase{}), "twice"},
		{"a password in plain env", []string{"gpuworker.env.OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=http://u:pw@collector:4318/v1/traces"},
			"gpuworker", secretCheck, "plain env"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			set := append([]string{"auth.key=" + testAuthKey}, tt.set...)
			m, err := helmtest.Render(testenv.ModuleRoot(t), helmtest.Release{Name: "kvmesh", Namespace: "kvmesh", Set: set})
			if err != nil {
				t.Fatal(err)
			}
			var errs []error
			for _, ct := range containers(t, m) {
				if ct.program == tt.program {
					errs = append(errs, tt.check(t, m, ct)...)
				}
			}
			if !slices.ContainsFunc(errs, func(err error) bool { return strings.Contains(err.Error(), tt.want) }) {
				t.Errorf("errors %v, want one saying %q", errors.Join(errs...), tt.want)
			}
		})
	}
}

func envCheck(t *testing.T, _ *helmtest.Manifests, c container) []error { return checkEnv(t, c) }

// authCheck is checkAuth against the expectations of c, plus checkEnv
// (which sees a variable set twice).
func authCheck(c renderCase) func(*testing.T, *helmtest.Manifests, container) []error {
	return func(t *testing.T, _ *helmtest.Manifests, ct container) []error {
		return append(checkAuth(c, ct), checkEnv(t, ct)...)
	}
}

func secretCheck(t *testing.T, m *helmtest.Manifests, c container) []error {
	return checkSecrets(t, m, c)
}

// TestMain removes the binaries the tests built (the kvmesh CLI).
func TestMain(m *testing.M) {
	code := m.Run()
	if err := testenv.RemoveBinaries(); err != nil {
		fmt.Fprintln(os.Stderr, "remove test binaries:", err)
	}
	os.Exit(code)
}

// kvmeshCLI is the CLI in the image, as the chart's containers run it.
const kvmeshCLI = "/usr/local/bin/kvmesh"

// TestChartQuotas checks the quota hook Job: none without quotas; with
// them one post-install and post-upgrade Job whose pod runs `kvmesh quota
// set` once per tenant, in the order listed (a container each: the image
// has no shell), from the mesh's image and as locked down as every kvmesh
// container, against the sender's Service (over HTTPS with tls.secretName,
// verified against the CA alone with verifyCA), with the operator token
// from the Secret the services read it from.
func TestChartQuotas(t *testing.T) {
	tests := []struct {
		name      string
		rel       helmtest.Release
		commands  [][]string // each container's; nil: no Job
		sender    string     // KVMESH_SENDER_URL
		ca        string     // KVMESH_HTTP_CA_FILE; empty: unset, and no volume
		tlsSecret string     // the Secret the CA is mounted from
	}{
		{name: "no quotas", rel: helmtest.Release{Name: "kvmesh", Namespace: "kvmesh",
			Set: []string{"auth.key=" + testAuthKey, "adminToken=tok"}}},
		{name: "multi-engine values", rel: helmtest.Release{Name: "prod", Namespace: "inference",
			ValuesFiles: []string{"ci/multi-engine-values.yaml"}},
			commands: [][]string{
				{kvmeshCLI, "quota", "set", "--max-bytes", "512GiB", "--max-keys", "2000000", "--", "acme"},
				{kvmeshCLI, "quota", "set", "--max-bytes", "1073741824", "--on-full", "skip", "--", "trial"},
			},
			sender: "http://prod-kvmesh-sender.inference.svc:8083"},
		{name: "existing secret", rel: helmtest.Release{Name: "kv", Namespace: "default",
			Set: []string{"existingSecret=kvmesh-credentials",
				"quotas[0].tenant=-b.c_d", "quotas[0].maxKeys=10", "quotas[0].onFull=evict",
				"quotas[1].tenant=e", "quotas[1].maxBytes=1.5GB"}},
			commands: [][]string{
				{kvmeshCLI, "quota", "set", "--max-keys", "10", "--on-full", "evict", "--", "-b.c_d"},
				{kvmeshCLI, "quota", "set", "--max-bytes", "1.5GB", "--", "e"},
			},
			sender: "http://kv-kvmesh-sender.default.svc:8083"},
		{name: "https with a CA", rel: helmtest.Release{Name: "kvmesh", Namespace: "kvmesh",
			Set: []string{"auth.key=" + testAuthKey, "adminToken=tok", "tls.secretName=kvmesh-tls",
				"quotas[0].tenant=a", "quotas[0].maxKeys=1"}},
			commands: [][]string{{kvmeshCLI, "quota", "set", "--max-keys", "1", "--", "a"}},
			sender:   "https://kvmesh-sender.kvmesh.svc:8083", ca: "/etc/kvmesh/tls/ca.crt", tlsSecret: "kvmesh-tls"},
		{name: "https, system roots", rel: helmtest.Release{Name: "kvmesh", Namespace: "kvmesh",
			Set: []string{"auth.key=" + testAuthKey, "adminToken=tok", "tls.secretName=kvmesh-tls", "tls.verifyCA=false",
				"quotas[0].tenant=a", "quotas[0].maxBytes=64MiB"}},
			commands: [][]string{{kvmeshCLI, "quota", "set", "--max-bytes", "64MiB", "--", "a"}},
			sender:   "https://kvmesh-sender.kvmesh.svc:8083"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m, err := helmtest.Render(testenv.ModuleRoot(t), tt.rel)
			if err != nil {
				t.Fatal(err)
			}
			if tt.commands == nil {
				if len(m.Jobs) != 0 {
					t.Errorf("%d Jobs, want none", len(m.Jobs))
				}
				return
			}
			if len(m.Jobs) != 1 {
				t.Fatalf("%d Jobs, want the quota Job", len(m.Jobs))
			}
			job := m.Jobs[0]
			if errs := validation.IsDNS1123Subdomain(job.Name); len(errs) > 0 {
				t.Errorf("Job %s: %v", job.Name, errs)
			}
			if got := job.Annotations["helm.sh/hook"]; got != "post-install,post-upgrade" {
				t.Errorf("Job %s: hook %q, want post-install,post-upgrade", job.Name, got)
			}
			if got := job.Annotations["helm.sh/hook-delete-policy"]; !strings.Contains(got, "before-hook-creation") {
				t.Errorf("Job %s: hook delete policy %q, want before-hook-creation (an upgrade replaces the Job)", job.Name, got)
			}
			spec := job.Spec.Template.Spec
			if spec.RestartPolicy != corev1.RestartPolicyOnFailure {
				t.Errorf("restart policy %q, want OnFailure (the sender may not be ready yet)", spec.RestartPolicy)
			}
			if spec.AutomountServiceAccountToken == nil || *spec.AutomountServiceAccountToken {
				t.Error("the Job mounts a service-account token")
			}
			if psc := spec.SecurityContext; psc == nil || psc.RunAsNonRoot == nil || !*psc.RunAsNonRoot {
				t.Errorf("pod security context %+v, want a non-root user", psc)
			}
			sender := senderContainer(t, m)
			checkSenderURL(t, m, sender, tt.sender)
			if len(spec.Containers) != len(tt.commands) {
				t.Fatalf("%d containers, want one per tenant, %d", len(spec.Containers), len(tt.commands))
			}
			for i, ctr := range spec.Containers {
				if !slices.Equal(ctr.Command, tt.commands[i]) {
					t.Errorf("%s: command %q, want %q", ctr.Name, ctr.Command, tt.commands[i])
				}
				if ctr.Image != sender.c.Image || ctr.ImagePullPolicy != sender.c.ImagePullPolicy {
					t.Errorf("%s: image %s (%s), want the mesh's %s (%s)", ctr.Name, ctr.Image, ctr.ImagePullPolicy, sender.c.Image, sender.c.ImagePullPolicy)
				}
				if err := checkContainerSecurity(ctr); err != nil {
					t.Errorf("%s: %v", ctr.Name, err)
				}
				checkQuotaEnv(t, m, sender, &ctr, tt.sender, tt.ca)
				mounts := make([]string, 0, 1)
				for _, vm := range ctr.VolumeMounts {
					mounts = append(mounts, fmt.Sprintf("%s:%s:%v", vm.Name, vm.MountPath, vm.ReadOnly))
				}
				if want := map[bool][]string{true: {"tls:" + path.Dir(tt.ca) + ":true"}, false: {}}[tt.ca != ""]; !slices.Equal(mounts, want) {
					t.Errorf("%s: mounts %q, want %q", ctr.Name, mounts, want)
				}
			}
			checkQuotaVolumes(t, spec.Volumes, tt.tlsSecret)
		})
	}
}

// senderContainer is the sender's container of a render.
func senderContainer(t *testing.T, m *helmtest.Manifests) container {
	t.Helper()
	for _, ct := range containers(t, m) {
		if ct.program == "sender" {
			return ct
		}
	}
	t.Fatal("no sender Deployment")
	return container{}
}

// checkSenderURL checks that want is the sender's Service: its name in
// the release's namespace, on its port.
func checkSenderURL(t *testing.T, m *helmtest.Manifests, sender container, want string) {
	t.Helper()
	for _, s := range m.Services {
		if s.Name != sender.deployment.Name {
			continue
		}
		host := fmt.Sprintf("%s.%s.svc:%d", s.Name, m.Namespace, s.Spec.Ports[0].Port)
		if !strings.HasSuffix(want, "://"+host) {
			t.Errorf("the quota Job's sender %s, want the sender's Service %s", want, host)
		}
		return
	}
	t.Errorf("no Service %s", sender.deployment.Name)
}

// checkQuotaEnv checks a quota container's environment: the sender's URL,
// the operator token from the Secret and key the sender reads it from
// (required: without it every quota set is refused), the CA when ca is
// set, and nothing else.
func checkQuotaEnv(t *testing.T, m *helmtest.Manifests, sender container, ctr *corev1.Container, url, ca string) {
	t.Helper()
	env, refs := resolve(m, ctr), secretRefs(ctr)
	want := deploy.Environment{"KVMESH_SENDER_URL": url, "KVMESH_ADMIN_TOKEN": sender.env["KVMESH_ADMIN_TOKEN"]}
	if ca != "" {
		want["KVMESH_HTTP_CA_FILE"] = ca
	}
	if fmt.Sprint(env) != fmt.Sprint(want) || len(ctr.Env) != len(want) {
		t.Errorf("%s: env %v, want %v", ctr.Name, env, want)
	}
	ref, wantRef := refs["KVMESH_ADMIN_TOKEN"], sender.refs["KVMESH_ADMIN_TOKEN"]
	switch {
	case ref == nil || wantRef == nil:
		t.Errorf("%s: KVMESH_ADMIN_TOKEN from %v, want the sender's Secret (%v)", ctr.Name, ref, wantRef)
	case ref.Name != wantRef.Name || ref.Key != wantRef.Key:
		t.Errorf("%s: KVMESH_ADMIN_TOKEN from %s/%s, want the sender's %s/%s", ctr.Name, ref.Name, ref.Key, wantRef.Name, wantRef.Key)
	case ref.Optional != nil && *ref.Optional:
		t.Errorf("%s: KVMESH_ADMIN_TOKEN is optional: a quota cannot be set without it", ctr.Name)
	}
}

// checkQuotaVolumes checks the quota pod's volumes: the CA alone of the
// tls Secret (no server key), readable by the pod's group, or none.
func checkQuotaVolumes(t *testing.T, vols []corev1.Volume, tlsSecret string) {
	t.Helper()
	if tlsSecret == "" {
		if len(vols) != 0 {
			t.Errorf("volumes %+v, want none", vols)
		}
		return
	}
	if len(vols) != 1 || vols[0].Name != "tls" || vols[0].Secret == nil {
		t.Fatalf("volumes %+v, want the tls Secret's CA", vols)
	}
	s := vols[0].Secret
	if s.SecretName != tlsSecret || len(s.Items) != 1 || s.Items[0].Key != "ca.crt" || s.Items[0].Path != "ca.crt" ||
		s.DefaultMode == nil || *s.DefaultMode != 0o440 {
		t.Errorf("tls volume %+v, want ca.crt alone of %s, mode 0440", s, tlsSecret)
	}
}

// TestChartQuotaJobRuns runs the quota Job's containers as the kubelet
// would — the real kvmesh CLI with each container's command and
// environment, the token read from the rendered Secret — against a
// stand-in for the sender's Service, and checks each PUTs its tenant's
// quota with the operator token: the chart's command lines are ones the
// CLI takes, and mean what the values say.
func TestChartQuotaJobRuns(t *testing.T) {
	i := slices.IndexFunc(cases, func(c renderCase) bool { return c.name == "multi-engine values" })
	if i < 0 || !cases[i].quotas {
		t.Fatal("no render case of the multi-engine values with their quotas")
	}
	m := render(t, cases[i])
	if len(m.Jobs) != 1 {
		t.Fatalf("%d Jobs, want the quota Job", len(m.Jobs))
	}
	token, ok := m.SecretValue(senderContainer(t, m).refs["KVMESH_ADMIN_TOKEN"].Name, "KVMESH_ADMIN_TOKEN")
	if !ok || token == "" {
		t.Fatal("the rendered Secret holds no KVMESH_ADMIN_TOKEN")
	}
	var mu sync.Mutex
	got := map[string]adminapi.TenantQuota{}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tenant, ok := strings.CutPrefix(r.URL.Path, "/v1/quotas/")
		if r.Method != http.MethodPut || !ok || r.Header.Get("Authorization") != "Bearer "+token {
			http.Error(w, "want PUT /v1/quotas/{tenant} with the operator token", http.StatusNotFound)
			return
		}
		var q adminapi.TenantQuota
		if err := json.NewDecoder(r.Body).Decode(&q); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		mu.Lock()
		got[tenant] = q
		mu.Unlock()
		q.UpdatedAt = time.Now().UTC()
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(q)
	}))
	defer srv.Close()
	cli := testenv.BuildBinary(t, "./cmd/kvmesh")
	for _, ctr := range m.Jobs[0].Spec.Template.Spec.Containers {
		if ctr.Command[0] != kvmeshCLI {
			t.Fatalf("%s: runs %s, want %s", ctr.Name, ctr.Command[0], kvmeshCLI)
		}
		env := resolve(m, &ctr)
		env["KVMESH_SENDER_URL"] = srv.URL
		cmd := exec.CommandContext(t.Context(), cli, ctr.Command[1:]...)
		for k, v := range env {
			cmd.Env = append(cmd.Env, k+"="+v)
		}
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Errorf("%s: %q: %v\n%s", ctr.Name, ctr.Command, err, out)
		}
	}
	want := map[string]adminapi.TenantQuota{
		"acme":  {Tenant: "acme", MaxBytes: 512 << 30, MaxKeys: 2_000_000, OnFull: adminapi.QuotaEvict},
		"trial": {Tenant: "trial", MaxBytes: 1 << 30, OnFull: adminapi.QuotaSkip},
	}
	mu.Lock()
	defer mu.Unlock()
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("quotas PUT %+v, want %+v", got, want)
	}
}

// TestChartKVEventsForm: kvEventsForm reaches the sender and every
// gpuworker as KVMESH_KV_EVENTS_FORM (map by default), and no other
// service.
func TestChartKVEventsForm(t *testing.T) {
	for _, tc := range []struct{ set, want string }{{"", "map"}, {"kvEventsForm=array", "array"}} {
		set := []string{"auth.key=" + testAuthKey}
		if tc.set != "" {
			set = append(set, tc.set)
		}
		m, err := helmtest.Render(testenv.ModuleRoot(t), helmtest.Release{Name: "kvmesh", Namespace: "kvmesh", Set: set})
		if err != nil {
			t.Fatal(err)
		}
		writers := 0
		for _, ct := range containers(t, m) {
			got, ok := ct.env["KVMESH_KV_EVENTS_FORM"]
			switch ct.program {
			case "sender", "gpuworker":
				writers++
				if !ok || got != tc.want {
					t.Errorf("%s (%s): KVMESH_KV_EVENTS_FORM %q, want %q", ct.deployment.Name, tc.set, got, tc.want)
				}
			default:
				if ok {
					t.Errorf("%s: sets KVMESH_KV_EVENTS_FORM, which only the sender and the gpuworkers read", ct.deployment.Name)
				}
			}
		}
		if writers < 3 {
			t.Errorf("%d containers of the sender and gpuworkers, want the sender and both gpuworkers", writers)
		}
	}
}
