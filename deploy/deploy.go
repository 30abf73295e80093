// Package deploy reads the deployment files kept in this directory and at
// the repository root — docker-compose.yml, the Dockerfile, the Grafana
// dashboards and the Prometheus, collector and Tempo configs — so that
// tests can hold them to the code: the environment each compose service
// sets must be settings its Config reads, the dashboards may only query
// metrics the services define, and so on. Docker is not needed: the files
// are parsed, not run.
package deploy

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"gopkg.in/yaml.v3"
)

// Paths of the deployment files, relative to the repository root.
const (
	ComposeFile       = "docker-compose.yml"
	Dockerfile        = "Dockerfile"
	DashboardsDir     = "deploy/grafana/dashboards"
	DatasourcesFile   = "deploy/grafana/provisioning/datasources/datasources.yaml"
	DashboardProvider = "deploy/grafana/provisioning/dashboards/dashboards.yaml"
	PrometheusFile    = "deploy/prometheus.yml"
	CollectorFile     = "deploy/otel-collector.yaml"
	TempoFile         = "deploy/tempo.yaml"
)

// Errors of the parsers.
var (
	// ErrSyntax reports a compose value of an unexpected shape.
	ErrSyntax = errors.New("unexpected syntax")
	// ErrInterpolation reports a ${VAR:?message} whose variable is unset.
	ErrInterpolation = errors.New("interpolation")
)

// Compose is the part of a compose file the checks read.
type Compose struct {
	// Services are the compose services by name.
	Services map[string]Service `yaml:"services"`
	// Volumes are the named volumes.
	Volumes map[string]any `yaml:"volumes"`
}

// Service is one compose service.
type Service struct {
	// Image is the image name (with tag).
	Image string `yaml:"image"`
	// Build is how the image is built; nil for pulled images.
	Build *Build `yaml:"build"`
	// Entrypoint replaces the image's entrypoint.
	Entrypoint StringList `yaml:"entrypoint"`
	// Command replaces the image's command.
	Command StringList `yaml:"command"`
	// Environment is the service's environment, list and map forms alike.
	Environment Environment `yaml:"environment"`
	// Ports are the published ports.
	Ports []Port `yaml:"ports"`
	// Expose lists ports reachable by other services only.
	Expose StringList `yaml:"expose"`
	// DependsOn lists the services started first, short and long forms alike.
	DependsOn DependsOn `yaml:"depends_on"`
	// Healthcheck is the service's health check, if any.
	Healthcheck *Healthcheck `yaml:"healthcheck"`
	// Volumes are the service's mounts.
	Volumes []Volume `yaml:"volumes"`
	// Profiles put the service outside the default `docker compose up`.
	Profiles []string `yaml:"profiles"`
	// Restart is the restart policy.
	Restart string `yaml:"restart"`
	// User overrides the image's user.
	User string `yaml:"user"`
}

// Program is the base name of the program the service's entrypoint runs;
// empty when the image's own entrypoint is used.
func (s Service) Program() string {
	if len(s.Entrypoint) == 0 {
		return ""
	}
	return filepath.Base(s.Entrypoint[0])
}

// Build is a service's build section.
type Build struct {
	// Context is the build context directory.
	Context string `yaml:"context"`
	// Dockerfile is the Dockerfile path inside the context.
	Dockerfile string `yaml:"dockerfile"`
	// Target is the stage built, if not the last.
	Target string `yaml:"target"`
}

// UnmarshalYAML accepts the short form (a context path) and the long form.
func (b *Build) UnmarshalYAML(n *yaml.Node) error {
	if n.Kind == yaml.ScalarNode {
		b.Context = n.Value
		return nil
	}
	type plain Build
	return n.Decode((*plain)(b))
}

// DockerfilePath is the Dockerfile the build uses, relative to the compose
// file's directory.
func (b *Build) DockerfilePath() string {
	name := b.Dockerfile
	if name == "" {
		name = "Dockerfile"
	}
	return filepath.Join(b.Context, name)
}

// StringList is a list of strings written as a YAML sequence or as one
// string (split on white space, as compose splits a command string).
type StringList []string

// UnmarshalYAML accepts a sequence of scalars or one scalar.
func (l *StringList) UnmarshalYAML(n *yaml.Node) error {
	switch n.Kind {
	case yaml.ScalarNode:
		*l = strings.Fields(n.Value)
		return nil
	case yaml.SequenceNode:
		var items []string
		if err := n.Decode(&items); err != nil {
			return err
		}
		*l = items
		return nil
	}
	return fmt.Errorf("%w: line %d: want a string or a list of strings", ErrSyntax, n.Line)
}

// Environment maps variable names to values.
type Environment map[string]string

// UnmarshalYAML accepts the map form (NAME: value) and the list form
// (- NAME=value); a list item without "=" or a null value is an empty value.
func (e *Environment) UnmarshalYAML(n *yaml.Node) error {
	out := Environment{}
	switch n.Kind {
	case yaml.MappingNode:
		var m map[string]*string
		if err := n.Decode(&m); err != nil {
			return err
		}
		for k, v := range m {
			if v != nil {
				out[k] = *v
			} else {
				out[k] = ""
			}
		}
	case yaml.SequenceNode:
		var items []string
		if err := n.Decode(&items); err != nil {
			return err
		}
		for _, item := range items {
			k, v, _ := strings.Cut(item, "=")
			out[k] = v
		}
	default:
		return fmt.Errorf("%w: line %d: environment must be a map or a list", ErrSyntax, n.Line)
	}
	*e = out
	return nil
}

// Dependency is one depends_on entry.
type Dependency struct {
	// Condition is service_started, service_healthy or
	// service_completed_successfully.
	Condition string `yaml:"condition"`
}

// Conditions of a dependency.
const (
	ConditionStarted   = "service_started"
	ConditionHealthy   = "service_healthy"
	ConditionCompleted = "service_completed_successfully"
)

// DependsOn maps the services a service depends on to their conditions.
type DependsOn map[string]Dependency

// UnmarshalYAML accepts the short form (a list of names, each
// service_started) and the long form (a map with conditions).
func (d *DependsOn) UnmarshalYAML(n *yaml.Node) error {
	out := DependsOn{}
	switch n.Kind {
	case yaml.SequenceNode:
		var names []string
		if err := n.Decode(&names); err != nil {
			return err
		}
		for _, name := range names {
			out[name] = Dependency{Condition: ConditionStarted}
		}
	case yaml.MappingNode:
		var m map[string]Dependency
		if err := n.Decode(&m); err != nil {
			return err
		}
		for name, dep := range m {
			if dep.Condition == "" {
				dep.Condition = ConditionStarted
			}
			out[name] = dep
		}
	default:
		return fmt.Errorf("%w: line %d: depends_on must be a list or a map", ErrSyntax, n.Line)
	}
	*d = out
	return nil
}

// Healthcheck is a service's health check.
type Healthcheck struct {
	// Test is the check command (["CMD", ...], ["CMD-SHELL", "..."] or a string).
	Test StringList `yaml:"test"`
	// Disable turns the image's check off.
	Disable bool `yaml:"disable"`
}

// Port is one published port.
type Port struct {
	// HostIP is the host address it binds, if any.
	HostIP string `yaml:"host_ip"`
	// Published is the host port; empty for a random one.
	Published string `yaml:"published"`
	// Target is the container port.
	Target string `yaml:"target"`
	// Protocol is tcp or udp; empty means tcp.
	Protocol string `yaml:"protocol"`
}

// UnmarshalYAML accepts the short form ("[ip:][host:]container[/proto]")
// and the long form.
func (p *Port) UnmarshalYAML(n *yaml.Node) error {
	if n.Kind != yaml.ScalarNode {
		type plain Port
		return n.Decode((*plain)(p))
	}
	spec, proto, _ := strings.Cut(n.Value, "/")
	parts := strings.Split(spec, ":")
	switch len(parts) {
	case 1:
		*p = Port{Target: parts[0]}
	case 2:
		*p = Port{Published: parts[0], Target: parts[1]}
	case 3:
		*p = Port{HostIP: parts[0], Published: parts[1], Target: parts[2]}
	default:
		return fmt.Errorf("%w: line %d: port %q", ErrSyntax, n.Line, n.Value)
	}
	p.Protocol = proto
	return nil
}

// Volume is one mount of a service.
type Volume struct {
	// Type is bind or volume.
	Type string `yaml:"type"`
	// Source is the host path (bind) or the volume name.
	Source string `yaml:"source"`
	// Target is the path inside the container.
	Target string `yaml:"target"`
	// ReadOnly reports a read-only mount.
	ReadOnly bool `yaml:"read_only"`
}

// UnmarshalYAML accepts the short form ("source:target[:ro]") and the
// long form. A short source starting with "." or "/" is a bind mount.
func (v *Volume) UnmarshalYAML(n *yaml.Node) error {
	if n.Kind != yaml.ScalarNode {
		type plain Volume
		return n.Decode((*plain)(v))
	}
	parts := strings.Split(n.Value, ":")
	if len(parts) < 2 || len(parts) > 3 {
		return fmt.Errorf("%w: line %d: volume %q", ErrSyntax, n.Line, n.Value)
	}
	*v = Volume{Type: "volume", Source: parts[0], Target: parts[1]}
	if strings.HasPrefix(v.Source, ".") || strings.HasPrefix(v.Source, "/") {
		v.Type = "bind"
	}
	if len(parts) == 3 {
		v.ReadOnly = strings.Contains(","+parts[2]+",", ",ro,")
	}
	return nil
}

// LoadCompose reads root's compose file with every ${VAR...} replaced as
// if no variable were set, so the file's own defaults are what is checked.
func LoadCompose(root string) (*Compose, error) {
	data, err := os.ReadFile(filepath.Join(root, ComposeFile))
	if err != nil {
		return nil, err
	}
	c, err := ParseCompose(data, func(string) (string, bool) { return "", false })
	if err != nil {
		return nil, fmt.Errorf("%s: %w", ComposeFile, err)
	}
	return c, nil
}

// ParseCompose parses a compose file, interpolating variables from lookup
// first as compose does.
func ParseCompose(data []byte, lookup func(string) (string, bool)) (*Compose, error) {
	var doc yaml.Node
	if err := yaml.Unmarshal(data, &doc); err != nil {
		return nil, err
	}
	if err := interpolateNode(&doc, lookup, map[*yaml.Node]bool{}); err != nil {
		return nil, err
	}
	var c Compose
	if err := doc.Decode(&c); err != nil {
		return nil, err
	}
	return &c, nil
}

// interpolateNode interpolates every scalar under n once.
func interpolateNode(n *yaml.Node, lookup func(string) (string, bool), seen map[*yaml.Node]bool) error {
	if n == nil || seen[n] {
		return nil
	}
	seen[n] = true
	if n.Kind == yaml.ScalarNode {
		v, err := Interpolate(n.Value, lookup)
		if err != nil {
			return fmt.Errorf("line %d: %w", n.Line, err)
		}
		n.Value = v
		return nil
	}
	for _, c := range n.Content {
		if err := interpolateNode(c, lookup, seen); err != nil {
			return err
		}
	}
	return interpolateNode(n.Alias, lookup, seen)
}
