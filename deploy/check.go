package deploy

import (
	"fmt"
	"maps"
	"net"
	"net/url"
	"reflect"
	"slices"
	"strings"

	"github.com/kvmesh/kvmesh/pkg/config"
	"github.com/kvmesh/kvmesh/pkg/contract"
)

// ServiceAddrs maps each kvmesh service program to its contract listen
// address.
var ServiceAddrs = map[string]string{
	"lookup":    contract.LookupAddr,
	"scheduler": contract.SchedulerAddr,
	"sender":    contract.SenderAddr,
	"gpuworker": contract.GPUWorkerAddr,
}

// MigrateService is the compose service that applies the database
// migrations before any service that uses the database starts.
const MigrateService = "migrate"

// schemePorts are the default ports of URL schemes used in settings.
var schemePorts = map[string]string{
	"postgres": "5432", "postgresql": "5432", "redis": "6379", "rediss": "6379", "http": "80", "https": "443",
	"redis+cluster": "6379", "rediss+cluster": "6379",
}

// ProgramServices returns the sorted names of the compose services whose
// entrypoint runs program.
func (c *Compose) ProgramServices(program string) []string {
	var out []string
	for name, s := range c.Services {
		if s.Program() == program {
			out = append(out, name)
		}
	}
	slices.Sort(out)
	return out
}

// Endpoint is a host and port that a setting points at.
type Endpoint struct {
	// Var is the environment variable.
	Var string
	// Host is the host name (a compose service inside the compose network).
	Host string
	// Port is the port, the scheme's default when the URL has none.
	Port string
}

// Endpoints returns the hosts the environment points at: every URL in a
// value (comma-separated values included) but a bind address of every
// interface (host "*", as the lookup's ZMQ endpoint tcp://*:5557), and
// every host:port of KVMESH_KAFKA_BROKERS.
func Endpoints(env Environment) ([]Endpoint, error) {
	var out []Endpoint
	for _, k := range slices.Sorted(maps.Keys(env)) {
		for _, item := range strings.Split(env[k], ",") {
			item = strings.TrimSpace(item)
			ep, ok, err := endpoint(k, item)
			if err != nil {
				return nil, err
			}
			if ok {
				out = append(out, ep)
			}
		}
	}
	return out, nil
}

// endpoint parses one value item; ok is false for items that are no address.
func endpoint(name, item string) (Endpoint, bool, error) {
	switch {
	case strings.Contains(item, "://"):
		u, err := url.Parse(item)
		if err != nil {
			return Endpoint{}, false, fmt.Errorf("%s: %w", name, err)
		}
		if u.Hostname() == "*" { // a bind address (tcp://*:5557): it points at no one
			return Endpoint{}, false, nil
		}
		port := u.Port()
		if port == "" {
			port = schemePorts[u.Scheme]
		}
		return Endpoint{Var: name, Host: u.Hostname(), Port: port}, true, nil
	case name == "KVMESH_KAFKA_BROKERS" && item != "":
		host, port, err := net.SplitHostPort(item)
		if err != nil {
			return Endpoint{}, false, fmt.Errorf("%s: %w", name, err)
		}
		return Endpoint{Var: name, Host: host, Port: port}, true, nil
	}
	return Endpoint{}, false, nil
}

// ListenPorts returns the container ports a service listens on as far as
// the compose file says: its expose list, its published ports' targets,
// and a kvmesh service's HTTP port.
func (c *Compose) ListenPorts(name string) []string {
	s := c.Services[name]
	ports := slices.Clone([]string(s.Expose))
	for _, p := range s.Ports {
		ports = append(ports, p.Target)
	}
	if addr, ok := ServiceAddrs[s.Program()]; ok {
		if v := s.Environment["KVMESH_HTTP_ADDR"]; v != "" {
			addr = v
		}
		if _, port, err := net.SplitHostPort(addr); err == nil {
			ports = append(ports, port)
		}
	}
	slices.Sort(ports)
	return slices.Compact(ports)
}

// CheckEndpoints reports every address in a service's environment that
// does not lead to a compose service listening on that port, that names
// a loopback address (inside a container it is the container itself), or
// whose service the service does not depend on (healthy, when the target
// has a health check).
func (c *Compose) CheckEndpoints(name string) []error {
	s, ok := c.Services[name]
	if !ok {
		return []error{fmt.Errorf("no compose service %q", name)}
	}
	eps, err := Endpoints(s.Environment)
	if err != nil {
		return []error{fmt.Errorf("%s: %w", name, err)}
	}
	var errs []error
	for _, ep := range eps {
		errs = append(errs, c.checkEndpoint(name, s, ep)...)
	}
	return errs
}

func (c *Compose) checkEndpoint(name string, s Service, ep Endpoint) []error {
	at := fmt.Sprintf("%s: %s points at %s:%s", name, ep.Var, ep.Host, ep.Port)
	if ip := net.ParseIP(ep.Host); ep.Host == "localhost" || ip != nil && ip.IsLoopback() {
		return []error{fmt.Errorf("%s, a loopback address: use a compose service name", at)}
	}
	target, ok := c.Services[ep.Host]
	if !ok {
		return []error{fmt.Errorf("%s, which is no compose service", at)}
	}
	var errs []error
	if !slices.Contains(c.ListenPorts(ep.Host), ep.Port) {
		errs = append(errs, fmt.Errorf("%s, but %s listens on %v", at, ep.Host, c.ListenPorts(ep.Host)))
	}
	if ep.Host == name {
		return errs
	}
	dep, ok := s.DependsOn[ep.Host]
	switch {
	case !ok:
		errs = append(errs, fmt.Errorf("%s but does not depend on %s", at, ep.Host))
	case target.Healthcheck != nil && !target.Healthcheck.Disable && dep.Condition != ConditionHealthy:
		errs = append(errs, fmt.Errorf("%s: depends on %s with %s, want %s (it has a health check)",
			name, ep.Host, dep.Condition, ConditionHealthy))
	}
	return errs
}

// CheckServiceConfig reports how compose service name disagrees with cfg,
// a pointer to the Config struct of the program it runs: KVMESH_* and
// OTEL_* variables the Config does not read, required settings left unset,
// settings config.Load rejects, an HTTP port other than the contract's or
// not published, no /readyz health check on it, no dependency on the
// migrate step when it uses the database, and bad endpoints (CheckEndpoints).
func (c *Compose) CheckServiceConfig(name string, cfg any) []error {
	s, ok := c.Services[name]
	if !ok {
		return []error{fmt.Errorf("no compose service %q", name)}
	}
	fields := config.Describe(cfg)
	if fields == nil {
		return []error{fmt.Errorf("%s: %T is not a config struct", name, cfg)}
	}
	errs := checkEnvFields(name, s.Environment, fields)
	if err := loadConfig(s.Environment, cfg); err != nil {
		errs = append(errs, fmt.Errorf("%s: its environment does not load: %w", name, err))
	}
	errs = append(errs, c.checkHTTP(name, s, fields)...)
	if _, ok := s.Environment["KVMESH_DATABASE_URL"]; ok && s.DependsOn[MigrateService].Condition != ConditionCompleted {
		errs = append(errs, fmt.Errorf("%s: uses the database but does not depend on %s with %s",
			name, MigrateService, ConditionCompleted))
	}
	return append(errs, c.CheckEndpoints(name)...)
}

// checkEnvFields reports variables cfg does not read and required
// settings without a value.
func checkEnvFields(name string, env Environment, fields []config.Field) []error {
	var errs []error
	known := map[string]bool{}
	for _, f := range fields {
		known[f.Env] = true
		if f.Required && f.Default == "" && strings.TrimSpace(env[f.Env]) == "" {
			errs = append(errs, fmt.Errorf("%s: required %s is not set", name, f.Env))
		}
	}
	for _, k := range slices.Sorted(maps.Keys(env)) {
		if (strings.HasPrefix(k, "KVMESH_") || strings.HasPrefix(k, "OTEL_")) && !known[k] {
			errs = append(errs, fmt.Errorf("%s: sets %s, which its Config does not read", name, k))
		}
	}
	return errs
}

// loadConfig loads a fresh value of cfg's type from env, as the service
// would at start (Validate included).
func loadConfig(env Environment, cfg any) error {
	t := reflect.TypeOf(cfg)
	if t.Kind() != reflect.Pointer || t.Elem().Kind() != reflect.Struct {
		return fmt.Errorf("%T is not a pointer to a struct", cfg)
	}
	fresh := reflect.New(t.Elem()).Interface()
	return config.Load(fresh, func(k string) (string, bool) {
		v, ok := env[k]
		return v, ok
	})
}

// checkHTTP checks the HTTP port against the contract, the published
// ports and the health check.
func (c *Compose) checkHTTP(name string, s Service, fields []config.Field) []error {
	program := s.Program()
	want, ok := ServiceAddrs[program]
	if !ok {
		return []error{fmt.Errorf("%s: runs %q, which is no kvmesh service", name, program)}
	}
	_, wantPort, _ := net.SplitHostPort(want)
	addr := s.Environment["KVMESH_HTTP_ADDR"]
	for _, f := range fields {
		if f.Env == "KVMESH_HTTP_ADDR" {
			if _, p, _ := net.SplitHostPort(f.Default); p != wantPort {
				return []error{fmt.Errorf("%s: the Config's default KVMESH_HTTP_ADDR %q is not the contract's %q", name, f.Default, want)}
			}
			if addr == "" {
				addr = f.Default
			}
		}
	}
	_, port, err := net.SplitHostPort(addr)
	if err != nil || port != wantPort {
		return []error{fmt.Errorf("%s: KVMESH_HTTP_ADDR %q, want port %s (contract %s)", name, addr, wantPort, want)}
	}
	var errs []error
	if !publishes(s, port, name == program) {
		errs = append(errs, fmt.Errorf("%s: does not publish container port %s%s", name, port,
			map[bool]string{true: " on the same host port", false: ""}[name == program]))
	}
	if !probesReadyz(s, port) {
		errs = append(errs, fmt.Errorf("%s: no health check probing http://127.0.0.1:%s/readyz", name, port))
	}
	return errs
}

// publishes reports whether s publishes container port (on the same host
// port when samePort is set).
func publishes(s Service, port string, samePort bool) bool {
	for _, p := range s.Ports {
		if p.Target == port && (!samePort || p.Published == port) {
			return true
		}
	}
	return false
}

// probesReadyz reports whether the health check requests /readyz on port.
func probesReadyz(s Service, port string) bool {
	if s.Healthcheck == nil || s.Healthcheck.Disable {
		return false
	}
	for _, arg := range s.Healthcheck.Test {
		for _, host := range []string{"127.0.0.1", "localhost"} {
			if strings.Contains(arg, "http://"+host+":"+port+"/readyz") {
				return true
			}
		}
	}
	return false
}
