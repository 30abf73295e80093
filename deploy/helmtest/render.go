// Package helmtest renders the Helm chart in deploy/helm/kvmesh with Helm's
// Go SDK (no helm binary) and decodes the manifests into the Kubernetes API
// types, so that its tests can hold the chart to the code the way deploy's
// tests hold docker-compose.yml to it. It is a package of its own because
// the SDK links the Kubernetes libraries: only this package pays for them.
package helmtest

import (
	"errors"
	"fmt"
	"maps"
	"path/filepath"
	"slices"
	"strings"

	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/engine"
	"helm.sh/helm/v3/pkg/releaseutil"
	"helm.sh/helm/v3/pkg/strvals"
	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"
)

// ChartDir is the chart's directory, relative to the repository root.
const ChartDir = "deploy/helm/kvmesh"

// ErrUnknownKind reports a rendered manifest of a kind this package does
// not decode (a template added without a check).
var ErrUnknownKind = errors.New("unknown manifest kind")

// Release is what a render is asked for.
type Release struct {
	// Name and Namespace are the release's.
	Name, Namespace string
	// ValuesFiles are values files relative to the chart directory, applied
	// in order over the chart's values.yaml.
	ValuesFiles []string
	// Set are --set style overrides (name=value), applied last.
	Set []string
}

// Manifests are the decoded objects of one render.
type Manifests struct {
	// Deployments, Services, Secrets, ServiceMonitors, Jobs (the hooks)
	// and PersistentVolumeClaims by kind, in the order rendered (template
	// file name, then document).
	Deployments     []appsv1.Deployment
	Services        []corev1.Service
	Secrets         []corev1.Secret
	ServiceMonitors []ServiceMonitor
	Jobs            []batchv1.Job
	Claims          []corev1.PersistentVolumeClaim
	// Notes is the rendered NOTES.txt.
	Notes string
	// Namespace is the release's namespace.
	Namespace string
}

// ServiceMonitor is the part of a monitoring.coreos.com/v1 ServiceMonitor
// the chart writes; decoding is strict, so a field outside it fails.
type ServiceMonitor struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`
	// Spec is the monitor's spec.
	Spec ServiceMonitorSpec `json:"spec"`
}

// ServiceMonitorSpec selects Services and says how to scrape them.
type ServiceMonitorSpec struct {
	// Selector selects the Services by label.
	Selector metav1.LabelSelector `json:"selector"`
	// NamespaceSelector says in which namespaces.
	NamespaceSelector struct {
		// Any selects every namespace.
		Any bool `json:"any,omitempty"`
		// MatchNames lists the namespaces.
		MatchNames []string `json:"matchNames,omitempty"`
	} `json:"namespaceSelector"`
	// TargetLabels are Service labels copied onto the scraped series.
	TargetLabels []string `json:"targetLabels,omitempty"`
	// Endpoints are the scraped ports.
	Endpoints []Endpoint `json:"endpoints"`
}

// Endpoint is one scraped port of a ServiceMonitor.
type Endpoint struct {
	// Port is the Service port's name.
	Port string `json:"port"`
	// Path is the HTTP path scraped.
	Path string `json:"path"`
	// Interval and ScrapeTimeout are Prometheus durations.
	Interval      string `json:"interval,omitempty"`
	ScrapeTimeout string `json:"scrapeTimeout,omitempty"`
}

// Render loads the chart under root, renders it for rel as `helm template`
// would (an install) and decodes every manifest strictly: a field the API
// type does not have is an error.
func Render(root string, rel Release) (*Manifests, error) {
	dir := filepath.Join(root, ChartDir)
	chrt, err := loader.Load(dir)
	if err != nil {
		return nil, fmt.Errorf("load chart: %w", err)
	}
	vals := map[string]any{}
	for _, f := range rel.ValuesFiles {
		v, err := chartutil.ReadValuesFile(filepath.Join(dir, f))
		if err != nil {
			return nil, fmt.Errorf("values %s: %w", f, err)
		}
		vals = chartutil.CoalesceTables(v.AsMap(), vals)
	}
	for _, s := range rel.Set {
		if err := strvals.ParseInto(s, vals); err != nil {
			return nil, fmt.Errorf("set %s: %w", s, err)
		}
	}
	opts := chartutil.ReleaseOptions{Name: rel.Name, Namespace: rel.Namespace, Revision: 1, IsInstall: true}
	top, err := chartutil.ToRenderValues(chrt, vals, opts, chartutil.DefaultCapabilities)
	if err != nil {
		return nil, fmt.Errorf("values: %w", err)
	}
	files, err := engine.Render(chrt, top)
	if err != nil {
		return nil, fmt.Errorf("render: %w", err)
	}
	m := &Manifests{Namespace: rel.Namespace}
	for _, name := range slices.Sorted(maps.Keys(files)) {
		if strings.HasSuffix(name, "NOTES.txt") {
			m.Notes = files[name]
			continue
		}
		docs := releaseutil.SplitManifests(files[name])
		for _, key := range slices.SortedFunc(maps.Keys(docs), manifestOrder) {
			if err := m.add(docs[key]); err != nil {
				return nil, fmt.Errorf("%s: %w", name, err)
			}
		}
	}
	return m, nil
}

// manifestOrder sorts SplitManifests' keys (manifest-0, manifest-1, ...,
// manifest-10) in document order.
func manifestOrder(a, b string) int {
	if len(a) != len(b) {
		return len(a) - len(b)
	}
	return strings.Compare(a, b)
}

// add decodes one manifest into its kind's list.
func (m *Manifests) add(doc string) error {
	if strings.TrimSpace(doc) == "" {
		return nil
	}
	var head metav1.TypeMeta
	if err := yaml.Unmarshal([]byte(doc), &head); err != nil {
		return fmt.Errorf("decode: %w", err)
	}
	var err error
	switch head.APIVersion + "/" + head.Kind {
	case "apps/v1/Deployment":
		m.Deployments, err = decodeInto(doc, m.Deployments)
	case "v1/Service":
		m.Services, err = decodeInto(doc, m.Services)
	case "v1/Secret":
		m.Secrets, err = decodeInto(doc, m.Secrets)
	case "monitoring.coreos.com/v1/ServiceMonitor":
		m.ServiceMonitors, err = decodeInto(doc, m.ServiceMonitors)
	case "batch/v1/Job":
		m.Jobs, err = decodeInto(doc, m.Jobs)
	case "v1/PersistentVolumeClaim":
		m.Claims, err = decodeInto(doc, m.Claims)
	default:
		return fmt.Errorf("%w: %s %s", ErrUnknownKind, head.APIVersion, head.Kind)
	}
	return err
}

// decodeInto decodes doc strictly and appends it to list.
func decodeInto[T any](doc string, list []T) ([]T, error) {
	var v T
	if err := yaml.UnmarshalStrict([]byte(doc), &v); err != nil {
		return list, fmt.Errorf("decode %T: %w", v, err)
	}
	return append(list, v), nil
}

// Secret returns the rendered Secret called name, or nil.
func (m *Manifests) Secret(name string) *corev1.Secret {
	for i := range m.Secrets {
		if m.Secrets[i].Name == name {
			return &m.Secrets[i]
		}
	}
	return nil
}

// SecretValue returns the value of key in the rendered Secret called name
// (its stringData or data); ok is false when the Secret is not rendered or
// lacks the key.
func (m *Manifests) SecretValue(name, key string) (string, bool) {
	s := m.Secret(name)
	if s == nil {
		return "", false
	}
	if v, ok := s.StringData[key]; ok {
		return v, true
	}
	v, ok := s.Data[key]
	return string(v), ok
}
