package helmtest_test

import (
	"fmt"
	"net"
	"path"
	"slices"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/labels"

	"github.com/kvmesh/kvmesh/deploy/helmtest"
	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/config"
	"github.com/kvmesh/kvmesh/pkg/kvtier"
)

// tierEnvVars are the capacity tier's settings (service.Tier).
var tierEnvVars = []string{"KVMESH_TIER_URL", "KVMESH_TIER_ACCESS_KEY", "KVMESH_TIER_SECRET_KEY",
	"KVMESH_TIER_REGION", "KVMESH_TIER_QUEUE_BYTES", "KVMESH_TIER_TIMEOUT"}

// readsTier reports whether program's Config reads the tier's settings:
// the chart must give them to exactly those programs.
func readsTier(t *testing.T, program string) bool {
	t.Helper()
	return slices.ContainsFunc(fieldsOf(t, program), func(f config.Field) bool { return f.Env == "KVMESH_TIER_URL" })
}

// tierServerWant is what an in-chart S3 server must look like.
type tierServerWant struct {
	bucket, size, storageClass, region string
}

// TestChartTier checks the capacity tier's values: off, nothing of it
// renders (tier.server.enabled alone included); on, every program whose
// Config reads the tier's settings — and no other — gets KVMESH_TIER_URL,
// the credentials through secretKeyRefs to the tier's Secret (the chart's,
// holding the values' keys, or tier.existingSecret), and the region,
// queue and timeout set; with tier.server.enabled, one versitygw
// Deployment, Service and claim that serve the URL's bucket with the same
// credentials, and nothing else of it.
func TestChartTier(t *testing.T) {
	const ak, sk = "tier-test-access", "tier-test-secret-0123456789"
	keys := []string{"tier.accessKey=" + ak, "tier.secretKey=" + sk}
	tests := []struct {
		name        string
		rel         helmtest.Release
		url         string            // the services' KVMESH_TIER_URL; empty: the tier is off
		secret      string            // the Secret of the credentials; empty: none (unsigned requests)
		chartSecret bool              // the chart renders that Secret, holding ak and sk
		plain       map[string]string // the other tier settings, in plain env
		server      *tierServerWant   // nil: no server
	}{
		{name: "default values, off", rel: helmtest.Release{Name: "kvmesh", Namespace: "kvmesh",
			Set: []string{"auth.key=" + testAuthKey}}},
		{name: "off with the server asked for", rel: helmtest.Release{Name: "kvmesh", Namespace: "kvmesh",
			Set: append([]string{"auth.key=" + testAuthKey, "tier.server.enabled=true", "tier.url=http://s3:9000/b"}, keys...)}},
		{name: "external bucket, credentials in values", rel: helmtest.Release{Name: "kvmesh", Namespace: "kvmesh",
			Set: append([]string{"auth.key=" + testAuthKey, "tier.enabled=true", "tier.url=https://s3.example.com/kv-cache/prod",
				"tier.region=eu-west-1", "tier.queueBytes=1073741824", "tier.timeout=15s"}, keys...)},
			url: "https://s3.example.com/kv-cache/prod", secret: "kvmesh-tier", chartSecret: true,
			plain: map[string]string{"KVMESH_TIER_REGION": "eu-west-1", "KVMESH_TIER_QUEUE_BYTES": "1073741824", "KVMESH_TIER_TIMEOUT": "15s"}},
		{name: "external bucket, existing secret", rel: helmtest.Release{Name: "prod", Namespace: "infer",
			Set: []string{"auth.key=" + testAuthKey, "tier.enabled=true", "tier.url=http://minio.storage:9000/kv",
				"tier.existingSecret=s3-credentials", "tier.accessKey=ignored", "tier.secretKey=ignored"}},
			url: "http://minio.storage:9000/kv", secret: "s3-credentials"},
		{name: "public bucket, no credentials", rel: helmtest.Release{Name: "kvmesh", Namespace: "kvmesh",
			Set: []string{"auth.key=" + testAuthKey, "tier.enabled=true", "tier.url=http://s3:9000/open"}},
			url: "http://s3:9000/open"},
		{name: "in-chart server", rel: helmtest.Release{Name: "kvmesh", Namespace: "kvmesh",
			Set: append([]string{"auth.key=" + testAuthKey, "tier.enabled=true", "tier.server.enabled=true"}, keys...)},
			url: "http://kvmesh-tier.kvmesh.svc:7070/kvmesh", secret: "kvmesh-tier", chartSecret: true,
			server: &tierServerWant{bucket: "kvmesh", size: "10Gi", region: "us-east-1"}},
		{name: "in-chart server, existing secret", rel: helmtest.Release{Name: "kv", Namespace: "default",
			Set: []string{"auth.key=" + testAuthKey, "tier.enabled=true", "tier.server.enabled=true", "tier.existingSecret=s3-root"}},
			url: "http://kv-kvmesh-tier.default.svc:7070/kvmesh", secret: "s3-root",
			server: &tierServerWant{bucket: "kvmesh", size: "10Gi", region: "us-east-1"}},
		{name: "tier values", rel: helmtest.Release{Name: "kvt", Namespace: "tiered", ValuesFiles: []string{"ci/tier-values.yaml"}},
			url: "http://kvt-kvmesh-tier.tiered.svc:7070/kv-cache", secret: "kvt-kvmesh-tier", chartSecret: true,
			plain:  map[string]string{"KVMESH_TIER_REGION": "eu-central-1", "KVMESH_TIER_QUEUE_BYTES": "536870912", "KVMESH_TIER_TIMEOUT": "10s"},
			server: &tierServerWant{bucket: "kv-cache", size: "50Gi", storageClass: "fast-ssd", region: "eu-central-1"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m, err := helmtest.Render(testenv.ModuleRoot(t), tt.rel)
			if err != nil {
				t.Fatal(err)
			}
			readers := 0
			for _, ct := range containers(t, m) {
				name := ct.deployment.Name
				reportAll(t, checkEnv(t, ct))
				reportAll(t, checkSecrets(t, m, ct))
				if tt.url == "" || !readsTier(t, ct.program) {
					for _, k := range tierEnvVars {
						if _, ok := ct.env[k]; ok {
							t.Errorf("%s: sets %s, want no tier setting", name, k)
						}
					}
					if _, ok := ct.deployment.Spec.Template.Annotations["checksum/tier-secret"]; ok {
						t.Errorf("%s: restarts with the tier's Secret, whose settings it does not get", name)
					}
					continue
				}
				readers++
				checkTierEnv(t, ct, tt.url, tt.secret, tt.plain)
				if _, ok := ct.deployment.Spec.Template.Annotations["checksum/tier-secret"]; ok != tt.chartSecret {
					t.Errorf("%s: checksum/tier-secret %v, want %v (a pod restarts when the chart's credentials change)", name, ok, tt.chartSecret)
				}
			}
			if want := map[bool]int{true: 3}[tt.url != ""]; readers < want {
				t.Errorf("%d containers get the tier's settings, want the lookup and both gpuworkers", readers)
			}
			if tt.url != "" {
				if _, err := kvtier.ParseURL(tt.url); err != nil {
					t.Errorf("KVMESH_TIER_URL %q: %v", tt.url, err)
				}
			}
			var tierSecrets []string
			for _, s := range m.Secrets {
				if s.Labels["app.kubernetes.io/component"] == tierComponent {
					tierSecrets = append(tierSecrets, s.Name)
				}
			}
			if want := map[bool][]string{true: {tt.secret}}[tt.chartSecret]; !slices.Equal(tierSecrets, want) {
				t.Errorf("the chart's tier Secrets %v, want %v", tierSecrets, want)
			}
			if tt.chartSecret {
				for k, want := range map[string]string{"accessKey": ak, "secretKey": sk} {
					if got, ok := m.SecretValue(tt.secret, k); !ok || got != want {
						t.Errorf("Secret %s: %s %q, want %q", tt.secret, k, got, want)
					}
				}
			}
			checkTierServer(t, m, tt.url, tt.secret, tt.server)
		})
	}
}

// checkTierEnv checks a tier reader's settings: the URL, the credentials
// from secret (keys accessKey and secretKey, required) or none, and plain
// (the region, queue and timeout set) exactly.
func checkTierEnv(t *testing.T, ct container, url, secret string, plain map[string]string) {
	t.Helper()
	name := ct.deployment.Name
	if got := ct.env["KVMESH_TIER_URL"]; got != url {
		t.Errorf("%s: KVMESH_TIER_URL %q, want %q", name, got, url)
	}
	for env, key := range map[string]string{"KVMESH_TIER_ACCESS_KEY": "accessKey", "KVMESH_TIER_SECRET_KEY": "secretKey"} {
		ref := ct.refs[env]
		switch {
		case secret == "" && (ref != nil || ct.env[env] != ""):
			t.Errorf("%s: %s set (%v), want none: no credentials", name, env, ref)
		case secret == "":
		case ref == nil:
			t.Errorf("%s: %s is not read from Secret %s", name, env, secret)
		case ref.Name != secret || ref.Key != key || ref.Optional != nil && *ref.Optional:
			t.Errorf("%s: %s from %s/%s (optional %v), want the required key %s of %s", name, env, ref.Name, ref.Key,
				ref.Optional != nil && *ref.Optional, key, secret)
		}
	}
	for _, k := range []string{"KVMESH_TIER_REGION", "KVMESH_TIER_QUEUE_BYTES", "KVMESH_TIER_TIMEOUT"} {
		if got, ok := ct.env[k]; got != plain[k] || ok != (plain[k] != "") {
			t.Errorf("%s: %s %q (set %v), want %q", name, k, got, ok, plain[k])
		}
	}
}

// checkTierServer checks the in-chart S3 server: none unless want; else
// one Deployment (one pod, replaced, never rolled), Service and claim of
// its own labels, selected by nothing of the mesh, running versitygw's
// posix backend on the claim with the bucket of url made first, on the
// port url names, probed on its health path, with the services'
// credentials as its root account.
func checkTierServer(t *testing.T, m *helmtest.Manifests, url, secret string, want *tierServerWant) {
	t.Helper()
	var deps []appsv1.Deployment
	var svcs []corev1.Service
	for _, d := range m.Deployments {
		if d.Labels["app.kubernetes.io/component"] == tierComponent {
			deps = append(deps, d)
		}
	}
	for _, s := range m.Services {
		if s.Labels["app.kubernetes.io/component"] == tierComponent {
			svcs = append(svcs, s)
		}
	}
	if want == nil {
		if len(deps)+len(svcs)+len(m.Claims) > 0 {
			t.Errorf("tier server objects %d Deployments, %d Services, %d claims, want none", len(deps), len(svcs), len(m.Claims))
		}
		return
	}
	if len(deps) != 1 || len(svcs) != 1 || len(m.Claims) != 1 {
		t.Fatalf("tier server objects %d Deployments, %d Services, %d claims, want one each", len(deps), len(svcs), len(m.Claims))
	}
	d, svc, claim := deps[0], svcs[0], m.Claims[0]
	if !isTierServer(d.Labels) || !isTierServer(svc.Labels) || !isTierServer(claim.Labels) {
		t.Errorf("tier server labels %v %v %v, want versitygw's, component %s", d.Labels, svc.Labels, claim.Labels, tierComponent)
	}
	if d.Spec.Replicas == nil || *d.Spec.Replicas != 1 || d.Spec.Strategy.Type != appsv1.RecreateDeploymentStrategyType {
		t.Errorf("%s: replicas %v strategy %q, want 1 and Recreate (one pod on a ReadWriteOnce claim)", d.Name, d.Spec.Replicas, d.Spec.Strategy.Type)
	}
	loc, err := kvtier.ParseURL(url)
	if err != nil {
		t.Fatal(err)
	}
	if loc.Bucket != want.bucket {
		t.Errorf("KVMESH_TIER_URL %s names bucket %s, want the server's %s", url, loc.Bucket, want.bucket)
	}
	host, port, err := net.SplitHostPort(loc.Endpoint)
	if err != nil || host != fmt.Sprintf("%s.%s.svc", svc.Name, m.Namespace) {
		t.Errorf("KVMESH_TIER_URL %s: host %q, want the server's Service %s.%s.svc", url, host, svc.Name, m.Namespace)
	}
	if len(svc.Spec.Ports) != 1 || fmt.Sprint(svc.Spec.Ports[0].Port) != port {
		t.Errorf("Service %s ports %+v, want %s (the URL's)", svc.Name, svc.Spec.Ports, port)
	}
	pods := labels.Set(d.Spec.Template.Labels)
	if !labels.SelectorFromSet(svc.Spec.Selector).Matches(pods) || !labels.SelectorFromSet(d.Spec.Selector.MatchLabels).Matches(pods) {
		t.Errorf("%s: its Service or its own selector does not select its pods", d.Name)
	}
	for _, s := range m.Services {
		if s.Name != svc.Name && labels.SelectorFromSet(s.Spec.Selector).Matches(pods) {
			t.Errorf("Service %s selects the tier server's pods", s.Name)
		}
	}
	for _, other := range m.Deployments {
		if other.Name != d.Name && labels.SelectorFromSet(svc.Spec.Selector).Matches(labels.Set(other.Spec.Template.Labels)) {
			t.Errorf("the tier server's Service selects %s's pods", other.Name)
		}
	}
	for _, sm := range m.ServiceMonitors {
		if labels.SelectorFromSet(sm.Spec.Selector.MatchLabels).Matches(labels.Set(svc.Labels)) {
			t.Errorf("ServiceMonitor %s scrapes the tier server, which serves no /metrics", sm.Name)
		}
	}
	spec := d.Spec.Template.Spec
	if len(spec.Containers) != 1 || len(spec.InitContainers) != 0 {
		t.Fatalf("%s: %d containers, %d init containers, want one container", d.Name, len(spec.Containers), len(spec.InitContainers))
	}
	c := spec.Containers[0]
	if c.Image != "versity/versitygw:v1.8.0" {
		t.Errorf("%s: image %s, want versity/versitygw:v1.8.0", d.Name, c.Image)
	}
	if !slices.Equal(c.Command, []string{"/bin/sh", "-c"}) || len(c.Args) != 1 {
		t.Fatalf("%s: command %q args %q, want /bin/sh -c SCRIPT", d.Name, c.Command, c.Args)
	}
	script := c.Args[0]
	mkdir, run, ok := strings.Cut(script, " && exec versitygw ")
	if !ok {
		t.Fatalf("%s: script %q: want `mkdir -p ... && exec versitygw ...`", d.Name, script)
	}
	args := strings.Fields(run)
	flag := func(args []string, name string) string {
		if i := slices.Index(args, name); i >= 0 && i+1 < len(args) {
			return args[i+1]
		}
		return ""
	}
	i := slices.Index(args, "posix")
	if i < 0 || i == len(args)-1 {
		t.Fatalf("%s: versitygw %q: want the posix backend and its data directory", d.Name, args)
	}
	dataDir, sidecar := args[len(args)-1], flag(args[i:], "--sidecar")
	if made := strings.Fields(mkdir); len(made) < 3 || made[0] != "mkdir" || made[1] != "-p" ||
		!slices.Contains(made, path.Join(dataDir, want.bucket)) || sidecar == "" || !slices.Contains(made, sidecar) {
		t.Errorf("%s: script %q: want the bucket %s and the sidecar directory made first", d.Name, script, path.Join(dataDir, want.bucket))
	}
	if p := flag(args, "--port"); p != ":"+port {
		t.Errorf("%s: versitygw --port %q, want :%s", d.Name, p, port)
	}
	if len(c.Ports) != 1 || fmt.Sprint(c.Ports[0].ContainerPort) != port || svc.Spec.Ports[0].TargetPort.String() != c.Ports[0].Name {
		t.Errorf("%s: container ports %+v, Service target %s, want %s", d.Name, c.Ports, svc.Spec.Ports[0].TargetPort.String(), port)
	}
	health := flag(args, "--health")
	for kind, p := range map[string]*corev1.Probe{"startup": c.StartupProbe, "liveness": c.LivenessProbe, "readiness": c.ReadinessProbe} {
		if p == nil || p.HTTPGet == nil || health == "" || p.HTTPGet.Path != health || p.HTTPGet.Port.String() != c.Ports[0].Name {
			t.Errorf("%s: %s probe %+v, want GET %s (--health) on the S3 port", d.Name, kind, p, health)
		}
	}
	env := resolve(m, &c)
	refs := secretRefs(&c)
	for envName, key := range map[string]string{"ROOT_ACCESS_KEY_ID": "accessKey", "ROOT_SECRET_ACCESS_KEY": "secretKey"} {
		if r := refs[envName]; r == nil || r.Name != secret || r.Key != key {
			t.Errorf("%s: %s from %v, want key %s of %s (the services' credentials)", d.Name, envName, r, key, secret)
		}
	}
	if env["VGW_REGION"] != want.region {
		t.Errorf("%s: VGW_REGION %q, want %q", d.Name, env["VGW_REGION"], want.region)
	}
	for _, e := range c.Env {
		if e.ValueFrom == nil && strings.Contains(strings.ToLower(e.Name), "secret") {
			t.Errorf("%s: %s in plain env", d.Name, e.Name)
		}
	}
	// The data and the metadata on the claim.
	var claimVolume string
	for _, v := range spec.Volumes {
		if v.PersistentVolumeClaim != nil && v.PersistentVolumeClaim.ClaimName == claim.Name {
			claimVolume = v.Name
		}
	}
	mounted := false
	for _, vm := range c.VolumeMounts {
		if vm.Name == claimVolume && !vm.ReadOnly && strings.HasPrefix(dataDir+"/", strings.TrimSuffix(vm.MountPath, "/")+"/") &&
			strings.HasPrefix(sidecar+"/", strings.TrimSuffix(vm.MountPath, "/")+"/") {
			mounted = true
		}
	}
	if claimVolume == "" || !mounted {
		t.Errorf("%s: volumes %+v mounts %+v: want claim %s holding %s and %s", d.Name, spec.Volumes, c.VolumeMounts, claim.Name, dataDir, sidecar)
	}
	storage := claim.Spec.Resources.Requests[corev1.ResourceStorage]
	if storage.String() != want.size || !slices.Equal(claim.Spec.AccessModes, []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce}) {
		t.Errorf("claim %s: %s %v, want %s ReadWriteOnce", claim.Name, storage.String(), claim.Spec.AccessModes, want.size)
	}
	if got := claim.Spec.StorageClassName; (got == nil) != (want.storageClass == "") || got != nil && *got != want.storageClass {
		t.Errorf("claim %s: storage class %v, want %q", claim.Name, got, want.storageClass)
	}
}

// TestChartTierRejectsBadValues checks the chart refuses tier values that
// would start no service, rather than rendering them.
func TestChartTierRejectsBadValues(t *testing.T) {
	on := []string{"auth.key=" + testAuthKey, "tier.enabled=true"}
	tests := []struct {
		name string
		set  []string
		want string
	}{
		{"no URL and no server", nil, "tier.url is required with tier.enabled"},
		{"a URL without a bucket", []string{"tier.url=http://s3:9000"}, `tier.url: "http://s3:9000" is not http(s)://host[:port]/bucket[/prefix]`},
		{"a URL of another scheme", []string{"tier.url=s3://bucket/prefix"}, "is not http(s)://host[:port]/bucket[/prefix]"},
		{"credentials in the URL", []string{"tier.url=http://ak:sk@s3:9000/b"}, "no credentials or query"},
		{"one key of two", []string{"tier.url=http://s3:9000/b", "tier.accessKey=a"}, "tier.accessKey and tier.secretKey: set both"},
		{"a server without credentials", []string{"tier.server.enabled=true"}, "tier.server.enabled needs the server's root credentials"},
		{"a bucket name S3 refuses", []string{"tier.server.enabled=true", "tier.accessKey=a", "tier.secretKey=b", "tier.server.bucket=KV_Cache"},
			`tier.server.bucket: "KV_Cache" is not an S3 bucket name`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := helmtest.Render(testenv.ModuleRoot(t), helmtest.Release{Name: "kvmesh", Namespace: "kvmesh", Set: append(slices.Clone(on), tt.set...)})
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("render error %v, want one saying %q", err, tt.want)
			}
		})
	}
}
