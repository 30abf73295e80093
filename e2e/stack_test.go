package e2e

import (
	"fmt"
	"testing"

	"github.com/kvmesh/kvmesh/internal/testenv/meshtest"
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
}

// stack is the mesh of one test: an in-process broker, a fresh database, the
// shared Redis under a key prefix of its own, and the services as
// subprocesses (lookup, scheduler, sender, and a gpuworker per engine).
type stack struct {
	t        *testing.T
	model    string // KVMESH_MODEL
	brokers  []string
	redisURL string
	prefix   string // KVMESH_KEY_PREFIX
	mesh     *meshtest.Mesh
}

// newStack starts everything and waits until every service is ready; the
// test's cleanup stops the services and deletes the stack's keys.
func newStack(t *testing.T, o stackOptions) *stack {
	t.Helper()
	newMesh := meshtest.New
	if o.durableBroker {
		newMesh = meshtest.NewDurable
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
	s := &stack{t: t, model: o.model, brokers: m.Brokers, redisURL: m.RedisURL, prefix: m.Prefix, mesh: m}
	pool := fmt.Sprintf("KVMESH_POOL_BLOCKS=%d", o.poolBlocks)
	s.add("scheduler", "scheduler", "KVMESH_MIGRATE=true")
	s.start("scheduler") // it migrates the database the others check
	s.add("lookup", "lookup", "KVMESH_LOOKUP_CONNECTORS="+o.connectors)
	s.add("sender", "sender")
	s.add("gpuworker", "gpuworker", "KVMESH_ENGINE_ID="+decodeEngine, pool)
	s.add("gpuworker-prefill", "gpuworker", "KVMESH_ENGINE_ID="+prefillEngine, pool)
	for _, name := range []string{"lookup", "sender", "gpuworker", "gpuworker-prefill"} {
		s.start(name)
	}
	return s
}

// add registers process name running service with the stack's settings
// plus env.
func (s *stack) add(name, service string, env ...string) {
	s.t.Helper()
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
