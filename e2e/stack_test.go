package e2e

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/pkg/dataplane"

	"github.com/kvmesh/kvmesh/internal/sim"
	"github.com/kvmesh/kvmesh/internal/testenv/meshtest"
	"github.com/kvmesh/kvmesh/pkg/config"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/service"
)

// Engine ids of the two gpuworkers every stack runs.
const (
	decodeEngine  = "decode-0"
	prefillEngine = "prefill-0"
	adminToken    = "e2e-admin-token"
)

// stackOptions shape one test's stack.
type stackOptions struct {
	// model is the KVMESH_MODEL of every service.
	model string
	// connectors is the lookup's chain.
	connectors string
	// poolBlocks is every gpuworker's KVMESH_POOL_BLOCKS.
	poolBlocks int
	// env is added to every service's environment.
	env []string
	// durableBroker persists the broker's topics and offsets so that the
	// test can restart it (meshtest.NewDurable).
	durableBroker bool
	// secure runs the stack over TLS and SASL everywhere (meshtest.NewSecure).
	secure bool
	// replicas, when 2 or more, runs that many processes each of the
	// scheduler, the sender and the lookup, named scheduler-1,
	// scheduler-2, … (the first scheduler migrates); they share the
	// database and the consumer groups. Otherwise one of each runs, named
	// after its service.
	replicas int
	// processEnv, when set, adds settings of each process's own (by
	// process name) to its environment.
	processEnv func(name string) []string
}

// stack is the mesh of one test: an in-process broker, a fresh database, the
// shared Redis under a key prefix of its own, and the services as
// subprocesses (lookup, scheduler, sender, and a gpuworker per engine).
type stack struct {
	t        testing.TB
	model    string // KVMESH_MODEL
	brokers  []string
	redisURL string
	prefix   string // KVMESH_KEY_PREFIX
	mesh     *meshtest.Mesh
	replicas int           // processes per replicated service (1: named after it)
	ranks    []kvcore.Rank // the worker ranks of every engine
	// processEnv is stackOptions.processEnv.
	processEnv func(name string) []string
}

// replicated are the services stackOptions.replicas multiplies.
var replicated = []string{"scheduler", "lookup", "sender"}

// newStack starts everything and waits until every service is ready; the
// test's cleanup stops the services and deletes the stack's keys.
func newStack(t testing.TB, o stackOptions) *stack {
	t.Helper()
	newMesh := meshtest.New
	switch {
	case o.durableBroker:
		newMesh = meshtest.NewDurable
	case o.secure:
		newMesh = meshtest.NewSecure
	}
	m := newMesh(t, "e2e", append([]string{
		"KVMESH_MODEL=" + o.model,
		"KVMESH_ADMIN_TOKEN=" + adminToken,
		"KVMESH_LOG_LEVEL=info",
		"KVMESH_SHUTDOWN_TIMEOUT=3s",
		// Short group sessions, so that a killed consumer's partitions move
		// to its replacement quickly.
		"KVMESH_KAFKA_SESSION_TIMEOUT=3s",
	}, o.env...)...)
	s := &stack{t: t, model: o.model, brokers: m.Brokers, redisURL: m.RedisURL, prefix: m.Prefix, mesh: m, replicas: max(o.replicas, 1),
		ranks: workerRanks(t, o), processEnv: o.processEnv}
	pool := fmt.Sprintf("KVMESH_POOL_BLOCKS=%d", o.poolBlocks)
	schedulers := s.names("scheduler")
	for i, name := range schedulers {
		s.add(name, "scheduler", "KVMESH_MIGRATE="+strconv.FormatBool(i == 0))
	}
	s.start(schedulers[0]) // it migrates the database the others check
	for _, name := range s.names("lookup") {
		s.add(name, "lookup", "KVMESH_LOOKUP_CONNECTORS="+o.connectors)
	}
	for _, name := range s.names("sender") {
		s.add(name, "sender")
	}
	workers := s.addWorkers(pool)
	rest := slices.Concat(schedulers[1:], s.names("lookup"), s.names("sender"), workers)
	for _, name := range rest {
		s.start(name)
	}
	return s
}

// addWorkers registers the gpuworkers of the decode and prefill engines,
// a process per worker rank of the stack's model, and returns their names.
func (s *stack) addWorkers(pool string) []string {
	s.t.Helper()
	var names []string
	for _, e := range []struct{ base, engine string }{{"gpuworker", decodeEngine}, {"gpuworker-prefill", prefillEngine}} {
		for k, r := range s.ranks {
			s.add(rankName(e.base, k), "gpuworker", "KVMESH_ENGINE_ID="+e.engine, pool,
				fmt.Sprintf("KVMESH_RANK_TP=%d", r.TP), fmt.Sprintf("KVMESH_RANK_PCP=%d", r.PCP),
				fmt.Sprintf("KVMESH_RANK_DCP=%d", r.DCP), fmt.Sprintf("KVMESH_RANK_PP=%d", r.PP))
		}
		names = append(names, s.workerNames(e.base)...)
	}
	return names
}

// credentials are what a simulator presents to the stack: engine tokens
// minted with the mesh's auth key and the stack's operator token.
func (s *stack) credentials() *sim.Credentials {
	return &sim.Credentials{Engine: sim.MintEngineTokens(s.mesh.AuthKey), Operator: adminToken}
}

// secured is cfg for a stack over TLS and SASL (sec non-nil): the
// simulator's Kafka clients use SCRAM over TLS, its store check the TLS
// Redis, and its HTTP client verifies the services' certificates.
func secured(cfg sim.Config, sec *meshtest.Secure) sim.Config {
	if sec == nil {
		return cfg
	}
	cfg.Kafka, cfg.RedisTLS = sec.Kafka, sec.RedisTLS
	tr := dataplane.DefaultTransport()
	tr.TLSClientConfig = sec.HTTPClient
	cfg.HTTPClient = dataplane.HTTPClient(tr)
	cfg.HTTPClient.Timeout = 30 * time.Second
	return cfg
}

// workerRanks resolves the worker ranks of o's model with the stack's
// environment (KVMESH_TP and the like in o.env).
func workerRanks(t testing.TB, o stackOptions) []kvcore.Rank {
	t.Helper()
	m, err := service.LoadModel(o.model)
	if err != nil {
		t.Fatal(err)
	}
	env := map[string]string{}
	for _, kv := range o.env {
		name, v, _ := strings.Cut(kv, "=")
		env[name] = v
	}
	var p service.ParallelOverride
	if err := config.Load(&p, func(name string) (string, bool) { v, ok := env[name]; return v, ok }); err != nil {
		t.Fatal(err)
	}
	if err := p.Apply(m); err != nil {
		t.Fatal(err)
	}
	return m.WorkerRanks()
}

// rankName is the process name of rank k of the engine whose rank-0 worker
// is base.
func rankName(base string, k int) string {
	if k == 0 {
		return base
	}
	return fmt.Sprintf("%s-rank%d", base, k)
}

// workerNames are the process names of every rank of the engine whose
// rank-0 worker is base.
func (s *stack) workerNames(base string) []string {
	out := make([]string, len(s.ranks))
	for k := range s.ranks {
		out[k] = rankName(base, k)
	}
	return out
}

// workerURLs are the base URLs of every rank of the engine whose rank-0
// worker is base, in rank order.
func (s *stack) workerURLs(base string) []string {
	var out []string
	for _, name := range s.workerNames(base) {
		out = append(out, s.url(name))
	}
	return out
}

// names are the process names of service: its replicas with
// stackOptions.replicas, else the service's own name.
func (s *stack) names(service string) []string {
	if s.replicas < 2 || !slices.Contains(replicated, service) {
		return []string{service}
	}
	out := make([]string, s.replicas)
	for i := range out {
		out[i] = fmt.Sprintf("%s-%d", service, i+1)
	}
	return out
}

// urls are the base URLs of service's processes (see names).
func (s *stack) urls(service string) []string {
	var out []string
	for _, name := range s.names(service) {
		out = append(out, s.url(name))
	}
	return out
}

// add registers process name running service with the stack's settings
// plus env.
func (s *stack) add(name, service string, env ...string) {
	s.t.Helper()
	if s.processEnv != nil {
		env = append(env, s.processEnv(name)...)
	}
	if _, err := s.mesh.Add(name, service, env...); err != nil {
		s.t.Fatal(err)
	}
}

// url is a service's base URL.
func (s *stack) url(name string) string { return s.mesh.Procs.Process(name).URL() }

// start starts (or restarts) a process and waits for its /readyz.
func (s *stack) start(name string) {
	s.t.Helper()
	if err := s.mesh.Procs.Process(name).Start(); err != nil {
		s.t.Fatal(err)
	}
}

// kill sends SIGKILL and waits until the process is gone.
func (s *stack) kill(name string) {
	s.t.Helper()
	if err := s.mesh.Procs.Process(name).Kill(); err != nil {
		s.t.Fatal(err)
	}
}

// alive reports whether the process is running and answers /healthz and
// /readyz with 200.
func (s *stack) alive(name string) error { return s.mesh.Procs.Process(name).Alive() }
