// Package meshtest gives a test the infrastructure to run kvmesh's services
// as real processes: the embedded Kafka-protocol broker over TCP, a fresh
// PostgreSQL database, the shared Redis under a key prefix of the test's own,
// the service binaries, and a testenv.Procs whose processes are pointed at
// all of them. The e2e tests and the CLI's tests build their meshes on it.
//
// It lives apart from testenv because it needs dbtest, which imports
// testenv, and devbroker, which testenv's many users need not build.
package meshtest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/kvmesh/kvmesh/internal/dbtest"
	"github.com/kvmesh/kvmesh/internal/devbroker"
	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/auth"
	"github.com/kvmesh/kvmesh/pkg/dataplane"
)

// Settings of the infrastructure.
const (
	// brokerStartWithin bounds the broker's start.
	brokerStartWithin = 30 * time.Second
	// groupMinSession lets the services run consumer group sessions of a
	// few seconds, so that a killed consumer's partitions move quickly.
	groupMinSession = time.Second
)

// Sentinel errors.
var (
	// errUnknownService reports a process of a service that is not in Services.
	errUnknownService = errors.New("no such service")
	// errNotDurable reports a broker restart on a mesh whose broker keeps
	// nothing across a restart (New instead of NewDurable).
	errNotDurable = errors.New("the broker of a mesh made by New keeps nothing across a restart: use NewDurable")
)

// Services are the service binaries a mesh builds, by name (./services/<name>).
var Services = []string{"lookup", "scheduler", "sender", "gpuworker"}

// Mesh is one test's infrastructure; everything in it goes away when the
// test ends, processes first.
type Mesh struct {
	// Brokers are the broker's addresses.
	Brokers []string
	// DatabaseURL is a fresh, empty database of the test's own; a service
	// started with KVMESH_MIGRATE=true migrates it.
	DatabaseURL string
	// RedisURL is the shared Redis.
	RedisURL string
	// Prefix is the test's store key prefix; its keys are deleted when the
	// test ends.
	Prefix string
	// Env is what every process gets besides the test process's own
	// environment: KVMESH_KAFKA_BROKERS, KVMESH_DATABASE_URL,
	// KVMESH_REDIS_URL and KVMESH_KEY_PREFIX, then New's env.
	Env []string
	// Procs runs the services with Env.
	Procs *testenv.Procs
	// AuthKey signs the engine and service tokens of the mesh's services
	// (KVMESH_AUTH_KEY in Env): every mesh authenticates its routes.
	AuthKey auth.Key
	// AuthSecret is AuthKey's text, for tests that craft their own tokens.
	AuthSecret string
	// AdminToken is the mesh's operator token (KVMESH_ADMIN_TOKEN in Env).
	AdminToken string
	// Secure is the transport security of a mesh made by NewSecure, nil
	// for New's.
	Secure *Secure

	bins      map[string]string
	broker    *devbroker.Broker // nil while stopped
	brokerCfg devbroker.Config
}

// New builds the services, starts the broker, creates the database and
// picks a key prefix starting with tag; env is added to every process's
// settings. Without PostgreSQL or Redis the test is skipped, or fails when
// KVMESH_REQUIRE_SERVICES=1.
func New(t testing.TB, tag string, env ...string) *Mesh {
	t.Helper()
	return newMesh(t, tag, "", env)
}

// NewDurable is New with a broker that keeps its topics, records and
// committed offsets in a directory of the test's own, so that RestartBroker
// can take it away and bring it back as a restarted Kafka would come back.
func NewDurable(t testing.TB, tag string, env ...string) *Mesh {
	t.Helper()
	return newMesh(t, tag, t.TempDir(), env)
}

func newMesh(t testing.TB, tag, brokerDir string, env []string) *Mesh {
	t.Helper()
	return build(t, tag, brokerDir, nil, env)
}

// build makes a mesh; with sec it runs over TLS and SASL (NewSecure).
func build(t testing.TB, tag, brokerDir string, sec *Secure, env []string) *Mesh {
	t.Helper()
	redisURL := testenv.RedisURL(t) // skips (or fails) before anything is built
	m := &Mesh{
		RedisURL: redisURL,
		Prefix:   testenv.KeyPrefix(tag),
		bins:     testenv.ServiceBinaries(t, Services...),
		Secure:   sec,
	}
	m.brokerCfg = devbroker.Config{Addr: "127.0.0.1:0", GroupMinSessionTimeout: groupMinSession, DataDir: brokerDir}
	var secEnv []string
	if sec != nil {
		secEnv = sec.setUp(t, m)
	} else {
		m.DatabaseURL = dbtest.NewDatabase(t)
		t.Cleanup(func() { testenv.DropKeys(t, redisURL, m.Prefix) })
	}
	if err := m.startBroker(); err != nil {
		t.Fatalf("broker: %v", err)
	}
	t.Cleanup(m.StopBroker)
	m.Brokers = m.broker.Addrs()
	m.brokerCfg.Addr = m.Brokers[0] // a restart listens where the services look
	secret, admin := randomSecret(t), randomSecret(t)
	key, err := auth.NewKey(secret)
	if err != nil {
		t.Fatal(err)
	}
	m.AuthKey, m.AuthSecret, m.AdminToken = key, secret, admin
	m.Env = slices.Concat([]string{
		"KVMESH_KAFKA_BROKERS=" + strings.Join(m.Brokers, ","),
		"KVMESH_DATABASE_URL=" + m.DatabaseURL,
		"KVMESH_REDIS_URL=" + m.RedisURL,
		"KVMESH_KEY_PREFIX=" + m.Prefix,
		"KVMESH_AUTH=" + auth.ModeRequired,
		"KVMESH_AUTH_KEY=" + secret,
		"KVMESH_ADMIN_TOKEN=" + admin,
	}, secEnv, env)
	m.Procs = testenv.NewProcs(t, m.Env...)
	if sec != nil {
		m.Procs.UseHTTPS(sec.HTTPClient)
	}
	return m
}

// randomSecret is 32 random bytes in hex.
func randomSecret(t testing.TB) string {
	t.Helper()
	b := make([]byte, 32)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(b)
}

// EngineToken mints a token of engine id, serving every tenant, valid for
// an hour.
func (m *Mesh) EngineToken(t testing.TB, id string) string {
	t.Helper()
	tok, err := m.AuthKey.Mint(auth.KindEngine, id, []string{auth.AnyTenant}, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	return tok
}

// EngineClient is a data-plane client of the gpuworker at url that carries
// engine id's token, as that engine's compute writes.
func (m *Mesh) EngineClient(t testing.TB, url, id string) *dataplane.Client {
	t.Helper()
	hc := &http.Client{Transport: auth.Transport(nil, auth.Static(m.EngineToken(t, id)))}
	t.Cleanup(hc.CloseIdleConnections)
	return dataplane.NewClient(url, hc)
}

// startBroker starts the broker with brokerCfg.
func (m *Mesh) startBroker() error {
	ctx, cancel := context.WithTimeout(context.Background(), brokerStartWithin)
	defer cancel()
	b, err := devbroker.Start(ctx, m.brokerCfg)
	if err != nil {
		return err
	}
	m.broker = b
	return nil
}

// StopBroker closes the broker: every client's connection drops and new
// ones are refused until StartBroker. Stopping a stopped broker does
// nothing.
func (m *Mesh) StopBroker() {
	if m.broker != nil {
		m.broker.Close()
		m.broker = nil
	}
}

// StartBroker brings a broker stopped by StopBroker back on the same
// address with what it had persisted; it needs a mesh made by NewDurable.
// It must not run concurrently with StopBroker.
func (m *Mesh) StartBroker() error {
	if m.brokerCfg.DataDir == "" {
		return errNotDurable
	}
	if m.broker != nil {
		return nil
	}
	return m.startBroker()
}

// Add registers process name running service (one of Services) with Env
// plus env; see testenv.Procs.Add.
func (m *Mesh) Add(name, service string, env ...string) (*testenv.Process, error) {
	bin, ok := m.bins[service]
	if !ok {
		return nil, fmt.Errorf("add %s: %w: %q (want one of %v)", name, errUnknownService, service, Services)
	}
	return m.Procs.Add(name, bin, env...)
}

// Start adds process name as Add does and starts it, waiting until it is
// ready (see testenv.Process.Start); it returns the process once added,
// even when it then fails to become ready. It may be called from any
// goroutine.
func (m *Mesh) Start(name, service string, env ...string) (*testenv.Process, error) {
	p, err := m.Add(name, service, env...)
	if err != nil {
		return nil, err
	}
	return p, p.Start()
}

// GPUWorkerName is the process name StartGPUWorkers gives the gpuworker of
// engine id.
func GPUWorkerName(id string) string { return "gpuworker-" + id }

// StartGPUWorkers starts one gpuworker per engine id, concurrently: a
// gpuworker serves one engine (KVMESH_ENGINE_ID), so a fleet of engines
// needs one each. Each process is named GPUWorkerName(id) and gets Env,
// KVMESH_ENGINE_ID and env; StartGPUWorkers waits until all are ready and
// returns them in the order of ids, or the first error. A gpuworker is
// ready once it registered in the database, which a scheduler started with
// KVMESH_MIGRATE=true migrates: start that first.
func (m *Mesh) StartGPUWorkers(ids []string, env ...string) ([]*testenv.Process, error) {
	procs := make([]*testenv.Process, len(ids))
	var g errgroup.Group
	for i, id := range ids {
		g.Go(func() error {
			p, err := m.Start(GPUWorkerName(id), "gpuworker", append([]string{"KVMESH_ENGINE_ID=" + id}, env...)...)
			procs[i] = p
			if err != nil {
				return fmt.Errorf("gpuworker of engine %s: %w", id, err)
			}
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		return nil, err
	}
	return procs, nil
}
