// Package deploy reads the deployment files kept in this directory and at
// the repository root — docker-compose.yml, the Dockerfile, the Grafana
// dashboards and the Prometheus, collector and Tempo configs — so that
// tests can hold them to the code: the environment each compose service
// sets must be settings its Config reads, the dashboards may only query
// metrics the services define, and so on. Docker is not needed: the files
// are parsed, not run.
package deploy

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"

	"github.com/compose-spec/compose-go/v2/loader"
	"github.com/compose-spec/compose-go/v2/template"
	"github.com/compose-spec/compose-go/v2/types"
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
	// ErrSyntax reports a compose file compose-go refuses: not YAML, a value
	// of an unexpected shape (the compose schema), or an invalid ${...}.
	ErrSyntax = errors.New("unexpected syntax")
	// ErrInterpolation reports a ${VAR:?message} whose variable is unset.
	ErrInterpolation = errors.New("interpolation")
)

// Compose is the part of a compose file the checks read, as compose-go
// loads it (interpolated, short forms expanded, anchors merged).
type Compose struct {
	// Services are the compose services by name, those of every profile.
	Services map[string]Service
	// Volumes are the named volumes.
	Volumes map[string]any
}

// Service is one compose service.
type Service struct {
	// Image is the image name (with tag).
	Image string
	// Build is how the image is built; nil for pulled images.
	Build *Build
	// Entrypoint replaces the image's entrypoint.
	Entrypoint StringList
	// Command replaces the image's command.
	Command StringList
	// Environment is the service's environment, list and map forms alike.
	Environment Environment
	// Ports are the published ports.
	Ports []Port
	// Expose lists ports reachable by other services only.
	Expose StringList
	// DependsOn lists the services started first, short and long forms alike.
	DependsOn DependsOn
	// Healthcheck is the service's health check, if any.
	Healthcheck *Healthcheck
	// Volumes are the service's mounts.
	Volumes []Volume
	// Profiles put the service outside the default `docker compose up`.
	Profiles []string
	// Restart is the restart policy.
	Restart string
	// User overrides the image's user.
	User string
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
	Context string
	// Dockerfile is the Dockerfile path inside the context.
	Dockerfile string
	// Target is the stage built, if not the last.
	Target string
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

// StringList is a list of strings: a command, an entrypoint or a health
// check test (compose splits a string form as a shell would).
type StringList []string

// Environment maps variable names to values; a variable listed without a
// value (and not set in the environment) has an empty value.
type Environment map[string]string

// Dependency is one depends_on entry.
type Dependency struct {
	// Condition is service_started, service_healthy or
	// service_completed_successfully.
	Condition string
	// Required is false for an optional dependency (required: false):
	// compose drops it when the service depended on does not run, as one
	// of a profile that is not enabled.
	Required bool
}

// Conditions of a dependency.
const (
	ConditionStarted   = "service_started"
	ConditionHealthy   = "service_healthy"
	ConditionCompleted = "service_completed_successfully"
)

// DependsOn maps the services a service depends on to their conditions.
type DependsOn map[string]Dependency

// Healthcheck is a service's health check.
type Healthcheck struct {
	// Test is the check command (["CMD", ...] or ["CMD-SHELL", "..."]).
	Test StringList
	// Disable turns the image's check off.
	Disable bool
}

// Port is one published port.
type Port struct {
	// HostIP is the host address it binds, if any.
	HostIP string
	// Published is the host port; empty for a random one.
	Published string
	// Target is the container port.
	Target string
	// Protocol is tcp or udp (compose fills in tcp).
	Protocol string
}

// Volume is one mount of a service.
type Volume struct {
	// Type is bind or volume.
	Type string
	// Source is the host path (bind), relative to the compose file's
	// directory as written, or the volume name.
	Source string
	// Target is the path inside the container.
	Target string
	// ReadOnly reports a read-only mount.
	ReadOnly bool
}

// LoadCompose reads root's compose file with every ${VAR...} replaced as
// if no variable were set, so the file's own defaults are what is checked.
func LoadCompose(root string) (*Compose, error) {
	data, err := os.ReadFile(filepath.Join(root, ComposeFile))
	if err != nil {
		return nil, fmt.Errorf("read compose file: %w", err)
	}
	c, err := parseCompose(root, data, func(string) (string, bool) { return "", false }, nil)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", ComposeFile, err)
	}
	return c, nil
}

// ParseCompose loads a compose file with compose-go, interpolating
// variables from lookup as compose does. Every profile's services are
// loaded; paths are kept as written; dependencies are not checked against
// the services (the deploy checks report those themselves).
func ParseCompose(data []byte, lookup func(string) (string, bool)) (*Compose, error) {
	return parseCompose(".", data, lookup, nil)
}

// ParseComposeProfiles loads a compose file as `docker compose --profile P
// ...` would for each of profiles (none: a plain `docker compose up`):
// only the services without a profile and those of an enabled profile,
// and the project's consistency checked as compose checks it before
// running anything (a service that depends on one that does not run is
// an error, unless the dependency is optional: required: false).
func ParseComposeProfiles(data []byte, lookup func(string) (string, bool), profiles []string) (*Compose, error) {
	if profiles == nil {
		profiles = []string{}
	}
	return parseCompose(".", data, lookup, profiles)
}

// parseCompose loads data as the compose file of directory dir: every
// profile's services without the consistency check when profiles is nil,
// else those profiles' with it.
func parseCompose(dir string, data []byte, lookup func(string) (string, bool), profiles []string) (*Compose, error) {
	details := types.ConfigDetails{
		WorkingDir:  dir,
		ConfigFiles: []types.ConfigFile{{Filename: filepath.Join(dir, ComposeFile), Content: data}},
		Environment: types.Mapping{},
	}
	p, err := loader.LoadWithContext(context.Background(), details, func(o *loader.Options) {
		o.SetProjectName("kvmesh", true)
		o.ResolvePaths = false
		o.SkipConsistencyCheck = profiles == nil
		o.Profiles = profiles
		if profiles == nil {
			o.Profiles = []string{"*"}
		}
		o.Interpolate.LookupValue = lookup
	})
	if err != nil {
		return nil, composeError(err)
	}
	c := &Compose{Services: map[string]Service{}, Volumes: map[string]any{}}
	for name, v := range p.Volumes {
		c.Volumes[name] = v
	}
	for name, s := range p.Services {
		c.Services[name] = service(s)
	}
	return c, nil
}

// composeError classifies an error of compose-go as ErrInterpolation (a
// ${VAR:?message} with VAR unset) or ErrSyntax.
func composeError(err error) error {
	var missing *template.MissingRequiredError
	var missingValue template.MissingRequiredError
	if errors.As(err, &missing) || errors.As(err, &missingValue) {
		return fmt.Errorf("%w: %w", ErrInterpolation, err)
	}
	return fmt.Errorf("%w: %w", ErrSyntax, err)
}

// service converts one compose-go service.
func service(s types.ServiceConfig) Service {
	out := Service{
		Image:       s.Image,
		Entrypoint:  StringList(s.Entrypoint),
		Command:     StringList(s.Command),
		Environment: Environment{},
		Expose:      StringList(s.Expose),
		DependsOn:   DependsOn{},
		Profiles:    s.Profiles,
		Restart:     s.Restart,
		User:        s.User,
	}
	if b := s.Build; b != nil {
		out.Build = &Build{Context: b.Context, Dockerfile: b.Dockerfile, Target: b.Target}
	}
	for k, v := range s.Environment {
		if v != nil {
			out.Environment[k] = *v
		} else {
			out.Environment[k] = ""
		}
	}
	for _, p := range s.Ports {
		out.Ports = append(out.Ports, Port{HostIP: p.HostIP, Published: p.Published, Target: strconv.FormatUint(uint64(p.Target), 10), Protocol: p.Protocol})
	}
	for name, d := range s.DependsOn {
		cond := d.Condition
		if cond == "" {
			cond = ConditionStarted
		}
		out.DependsOn[name] = Dependency{Condition: cond, Required: d.Required}
	}
	if h := s.HealthCheck; h != nil {
		out.Healthcheck = &Healthcheck{Test: StringList(h.Test), Disable: h.Disable}
	}
	for _, v := range s.Volumes {
		out.Volumes = append(out.Volumes, Volume{Type: v.Type, Source: v.Source, Target: v.Target, ReadOnly: v.ReadOnly})
	}
	return out
}
