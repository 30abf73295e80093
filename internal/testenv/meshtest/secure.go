package meshtest

import (
	"crypto/tls"
	"testing"

	"github.com/kvmesh/kvmesh/internal/devbroker"
	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
	"github.com/kvmesh/kvmesh/pkg/tlsfiles"
)

// saslUser is the Kafka user of a secure mesh.
const saslUser = "kvmesh"

// Secure is the transport security of a mesh made by NewSecure, and what a
// client of its services needs.
type Secure struct {
	// Certs are the test CA and the certificates every server presents.
	Certs *testenv.Certs
	// Kafka is a client's Kafka security: TLS verified with the test CA and
	// SCRAM-SHA-512 as the mesh's user.
	Kafka bus.Security
	// RedisTLS verifies the TLS Redis (whose URL, Mesh.RedisURL, names an
	// ACL user).
	RedisTLS kvstore.RedisTLS
	// HTTPClient verifies the services' HTTPS certificates.
	HTTPClient *tls.Config
}

// NewSecure is New over TLS and SASL everywhere: the broker takes only TLS
// connections that authenticate with SCRAM-SHA-512, Redis is a TLS-only
// redis-server with an ACL user, PostgreSQL a TLS-only cluster reached
// with sslmode=verify-full, and every service serves HTTPS with a
// certificate of the test CA, which verifies every connection.
func NewSecure(t testing.TB, tag string, env ...string) *Mesh {
	t.Helper()
	return build(t, tag, "", &Secure{}, env)
}

// setUp starts the TLS servers, configures the broker and returns the
// services' settings.
func (s *Secure) setUp(t testing.TB, m *Mesh) []string {
	t.Helper()
	s.Certs = testenv.NewCerts(t)
	c := s.Certs
	redis := testenv.StartTLSRedis(t, c, testenv.TLSRedisOptions{})
	m.RedisURL = redis.URL()
	pg := testenv.StartTLSPostgres(t, c)
	m.DatabaseURL = pg.URL("verify-full", c.CAFile)
	password := randomSecret(t)
	m.brokerCfg.TLS = tlsfiles.Files{CertFile: c.ServerCert, KeyFile: c.ServerKey}
	m.brokerCfg.SASLUsers = []devbroker.SASLUser{{Mechanism: bus.SASLScramSHA512, Name: saslUser, Password: password}}
	s.Kafka = bus.Security{TLS: true, CAFile: c.CAFile, SASLMechanism: bus.SASLScramSHA512, SASLUsername: saslUser, SASLPassword: password}
	s.RedisTLS = kvstore.RedisTLS{CAFile: c.CAFile}
	cfg, err := tlsfiles.Files{CAFile: c.CAFile}.Client()
	if err != nil {
		t.Fatal(err)
	}
	s.HTTPClient = cfg
	return []string{
		"KVMESH_KAFKA_TLS=true", "KVMESH_KAFKA_CA_FILE=" + c.CAFile,
		"KVMESH_KAFKA_SASL_MECHANISM=scram-sha-512", "KVMESH_KAFKA_SASL_USERNAME=" + saslUser,
		"KVMESH_KAFKA_SASL_PASSWORD=" + password,
		"KVMESH_REDIS_CA_FILE=" + c.CAFile,
		"KVMESH_HTTP_TLS_CERT_FILE=" + c.ServerCert, "KVMESH_HTTP_TLS_KEY_FILE=" + c.ServerKey,
		"KVMESH_HTTP_CA_FILE=" + c.CAFile,
	}
}
