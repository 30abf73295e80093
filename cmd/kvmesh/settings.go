package main

import (
	"fmt"
	"os"

	"github.com/kvmesh/kvmesh/internal/devbroker"
	"github.com/kvmesh/kvmesh/pkg/config"
	"github.com/kvmesh/kvmesh/pkg/contract"
)

// serviceURLs are the CLI's own settings: where the services it talks to
// answer. The services' settings (brokers, Redis, the admin token) are read
// through the structs the services embed.
type serviceURLs struct {
	Lookup        string `env:"KVMESH_LOOKUP_URL" doc:"base URL of the lookup (or its replicas', comma-separated, for kvmesh sim)"`
	Scheduler     string `env:"KVMESH_SCHEDULER_URL" doc:"base URL of the scheduler (or its replicas', comma-separated, for kvmesh sim)"`
	Sender        string `env:"KVMESH_SENDER_URL" doc:"base URL of the sender (or its replicas', comma-separated, for kvmesh sim)"`
	GPUWorker     string `env:"KVMESH_GPUWORKER_URL" doc:"gpuworker base URLs the admin commands ask, comma-separated"`
	Worker        string `env:"KVMESH_WORKER_URL" doc:"the decode engines' gpuworker base URLs kvmesh sim drives"`
	PrefillWorker string `env:"KVMESH_PREFILL_WORKER_URL" doc:"the prefill engines' gpuworker base URLs kvmesh sim drives with -pd (default: scripts/stack.sh's layout)"`
}

// SetDefaults points every URL at the services' default ports on loopback.
func (s *serviceURLs) SetDefaults() {
	s.Lookup = loopbackURL(contract.LookupAddr)
	s.Scheduler = loopbackURL(contract.SchedulerAddr)
	s.Sender = loopbackURL(contract.SenderAddr)
	s.GPUWorker = loopbackURL(contract.GPUWorkerAddr)
	s.Worker = loopbackURL(contract.GPUWorkerAddr)
}

// loopbackURL is http://127.0.0.1 at a service's default listen address.
func loopbackURL(addr string) string { return "http://127.0.0.1" + addr }

// brokerSettings are kvmesh devbroker's settings; its flags default to them.
type brokerSettings struct {
	Addr        string `env:"KVMESH_BROKER_ADDR" doc:"listen address; the host must be loopback, port 0 picks a free port"`
	Partitions  int    `env:"KVMESH_BROKER_PARTITIONS" doc:"partitions per topic"`
	DataDir     string `env:"KVMESH_BROKER_DATA_DIR" doc:"directory persisting topics, records and offsets; empty keeps them in memory"`
	TLSCert     string `env:"KVMESH_BROKER_TLS_CERT_FILE" doc:"PEM server certificate: with it (and the key) the broker accepts TLS connections only"`
	TLSKey      string `env:"KVMESH_BROKER_TLS_KEY_FILE" doc:"PEM private key of the server certificate"`
	TLSClientCA string `env:"KVMESH_BROKER_TLS_CLIENT_CA_FILE" doc:"PEM CA bundle: every client must present a certificate it verifies (mutual TLS)"`
	SASLUsers   string `env:"KVMESH_BROKER_SASL_USERS" secret:"true" doc:"require SASL as one of these users: comma-separated MECHANISM:NAME:PASSWORD"`
}

// SetDefaults is the contract's broker address and the default partitions.
func (s *brokerSettings) SetDefaults() {
	s.Addr = contract.BrokerAddr
	s.Partitions = devbroker.DefaultPartitions
}

// loadSettings reads one of the CLI's settings structs from the environment;
// a bad value is a usage error naming the variable.
func loadSettings[T any]() (T, error) {
	var s T
	if err := config.Load(&s, os.LookupEnv); err != nil {
		return s, fmt.Errorf("%w: %w", errUsage, err)
	}
	return s, nil
}
