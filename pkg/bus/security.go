package bus

import (
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/segmentio/kafka-go/sasl"
	"github.com/segmentio/kafka-go/sasl/plain"
	"github.com/segmentio/kafka-go/sasl/scram"

	"github.com/kvmesh/kvmesh/pkg/config"
	"github.com/kvmesh/kvmesh/pkg/tlsfiles"
)

// SASLMechanism names the SASL mechanism a Kafka client authenticates with.
// Values are matched without regard to case, so the Kafka spellings (PLAIN,
// SCRAM-SHA-256) are accepted too.
type SASLMechanism string

// The SASL mechanisms Security supports. They are untyped so that they
// set Security.SASLMechanism (a string, as pkg/config and the deploy
// checks read it) as well as a SASLMechanism.
const (
	// SASLNone authenticates with no SASL mechanism; the empty value means
	// the same.
	SASLNone = "none"
	// SASLPlain sends the username and password as they are (RFC 4616); use
	// it over TLS only.
	SASLPlain = "plain"
	// SASLScramSHA256 is SCRAM-SHA-256 (RFC 7677): the password never
	// crosses the wire.
	SASLScramSHA256 = "scram-sha-256"
	// SASLScramSHA512 is SCRAM-SHA-512.
	SASLScramSHA512 = "scram-sha-512"
)

// Normalized returns m in lower case with blanks trimmed, and SASLNone for
// the empty value; it does not check that m is known.
func (m SASLMechanism) Normalized() SASLMechanism {
	n := SASLMechanism(strings.ToLower(strings.TrimSpace(string(m))))
	if n == "" {
		return SASLNone
	}
	return n
}

// Known reports whether m (normalized) is SASLNone, SASLPlain,
// SASLScramSHA256 or SASLScramSHA512.
func (m SASLMechanism) Known() bool {
	switch m.Normalized() {
	case SASLNone, SASLPlain, SASLScramSHA256, SASLScramSHA512:
		return true
	}
	return false
}

// KafkaName returns the mechanism's name in the Kafka protocol (PLAIN,
// SCRAM-SHA-256, SCRAM-SHA-512), or "" for SASLNone and unknown values.
func (m SASLMechanism) KafkaName() string {
	switch m.Normalized() {
	case SASLPlain:
		return "PLAIN"
	case SASLScramSHA256:
		return "SCRAM-SHA-256"
	case SASLScramSHA512:
		return "SCRAM-SHA-512"
	}
	return ""
}

// securityDialTimeout is the connect timeout of the readers' dialer, as
// kafka-go's default dialer has.
const securityDialTimeout = 10 * time.Second

// Security is how a Kafka client secures its connections: TLS (verifying
// the brokers against a CA bundle, optionally presenting a client
// certificate) and SASL authentication. The zero value is plaintext without
// authentication, kafka-go's default. It is loaded from the environment by
// pkg/config (service.Common embeds it) and passed to NewProducer,
// EnsureTopics, Ping and NewLagCollector with WithSecurity, and to
// consumers in ConsumerConfig.Security.
type Security struct {
	// TLS connects over TLS. The other TLS fields require it.
	TLS bool `env:"KVMESH_KAFKA_TLS" doc:"connect to the Kafka brokers over TLS; required by the other KVMESH_KAFKA_*_FILE and KVMESH_KAFKA_SERVER_NAME settings"`
	// CAFile is the PEM bundle the brokers' certificates are verified
	// against; empty uses the system roots.
	CAFile string `env:"KVMESH_KAFKA_CA_FILE" doc:"PEM CA bundle the brokers' TLS certificates are verified against; empty uses the system roots"`
	// CertFile and KeyFile are a client certificate and its key, presented
	// to brokers that require mutual TLS.
	CertFile string `env:"KVMESH_KAFKA_CERT_FILE" doc:"PEM client certificate presented to brokers that require mutual TLS (needs KVMESH_KAFKA_KEY_FILE)"`
	// KeyFile is CertFile's private key.
	KeyFile string `env:"KVMESH_KAFKA_KEY_FILE" doc:"PEM private key of KVMESH_KAFKA_CERT_FILE"`
	// ServerName is the name checked against the brokers' certificates
	// when it is not the host dialled.
	ServerName string `env:"KVMESH_KAFKA_SERVER_NAME" doc:"name verified in the brokers' TLS certificates instead of the host dialled; empty verifies the host"`
	// SASLMechanism is the SASL mechanism, one of SASLMechanisms matched
	// without regard to case; SASLNone (or empty) for none.
	SASLMechanism string `env:"KVMESH_KAFKA_SASL_MECHANISM" doc:"SASL mechanism: none, plain, scram-sha-256 or scram-sha-512 (plain sends the password as is: use it with KVMESH_KAFKA_TLS)"`
	// SASLUsername is the SASL user.
	SASLUsername string `env:"KVMESH_KAFKA_SASL_USERNAME" doc:"SASL username; required with a SASL mechanism"`
	// SASLPassword is the SASL user's password.
	SASLPassword string `env:"KVMESH_KAFKA_SASL_PASSWORD" secret:"true" doc:"SASL password; required with a SASL mechanism (or KVMESH_KAFKA_SASL_PASSWORD_FILE)"`
}

// SetDefaults gives KVMESH_KAFKA_SASL_MECHANISM's default, SASLNone
// (config.Defaulter).
func (s *Security) SetDefaults() { s.SASLMechanism = SASLNone }

// LoadSecurity reads the KVMESH_KAFKA_* security settings through lookup
// (os.LookupEnv in a command) with pkg/config, so a password may also come
// from KVMESH_KAFKA_SASL_PASSWORD_FILE, and validates them.
func LoadSecurity(lookup func(string) (string, bool)) (Security, error) {
	var s Security
	if err := config.Load(&s, lookup); err != nil {
		return Security{}, fmt.Errorf("kafka security: %w", err)
	}
	return s, nil
}

// Validate reports every problem of s, each naming its variable: an unknown
// mechanism, a mechanism without its username or password (or credentials
// without a mechanism), TLS files or a server name without TLS, a
// certificate without its key (or the reverse), and TLS files that cannot
// be read. The errors wrap ErrInvalidConfig.
func (s Security) Validate() error {
	var errs []error
	bad := func(format string, args ...any) {
		errs = append(errs, fmt.Errorf("%w: "+format, append([]any{ErrInvalidConfig}, args...)...))
	}
	mech := SASLMechanism(s.SASLMechanism).Normalized()
	switch {
	case !mech.Known():
		bad("KVMESH_KAFKA_SASL_MECHANISM %q is not none, plain, scram-sha-256 or scram-sha-512", s.SASLMechanism)
	case mech == SASLNone && (s.SASLUsername != "" || s.SASLPassword != ""):
		bad("KVMESH_KAFKA_SASL_USERNAME or KVMESH_KAFKA_SASL_PASSWORD is set but KVMESH_KAFKA_SASL_MECHANISM is none")
	case mech != SASLNone:
		if s.SASLUsername == "" {
			bad("KVMESH_KAFKA_SASL_MECHANISM %s needs KVMESH_KAFKA_SASL_USERNAME", mech)
		}
		if s.SASLPassword == "" {
			bad("KVMESH_KAFKA_SASL_MECHANISM %s needs KVMESH_KAFKA_SASL_PASSWORD (or KVMESH_KAFKA_SASL_PASSWORD_FILE)", mech)
		}
	}
	if !s.TLS {
		for _, f := range []struct{ name, v string }{
			{"KVMESH_KAFKA_CA_FILE", s.CAFile}, {"KVMESH_KAFKA_CERT_FILE", s.CertFile},
			{"KVMESH_KAFKA_KEY_FILE", s.KeyFile}, {"KVMESH_KAFKA_SERVER_NAME", s.ServerName},
		} {
			if f.v != "" {
				bad("%s is set but KVMESH_KAFKA_TLS is not true", f.name)
			}
		}
	}
	switch {
	case s.CertFile != "" && s.KeyFile == "":
		bad("KVMESH_KAFKA_CERT_FILE needs KVMESH_KAFKA_KEY_FILE")
	case s.CertFile == "" && s.KeyFile != "":
		bad("KVMESH_KAFKA_KEY_FILE needs KVMESH_KAFKA_CERT_FILE")
	case s.TLS:
		if _, err := s.TLSConfig(); err != nil {
			bad("KVMESH_KAFKA_CA_FILE, KVMESH_KAFKA_CERT_FILE or KVMESH_KAFKA_KEY_FILE: %w", err)
		}
	}
	return errors.Join(errs...)
}

// TLSConfig returns the client TLS configuration, read from the PEM files
// now, or nil when TLS is off.
func (s Security) TLSConfig() (*tls.Config, error) {
	if !s.TLS {
		return nil, nil
	}
	cfg, err := tlsfiles.Files{CAFile: s.CAFile, CertFile: s.CertFile, KeyFile: s.KeyFile, ServerName: s.ServerName}.Client()
	if err != nil {
		return nil, fmt.Errorf("bus: kafka TLS: %w", err)
	}
	return cfg, nil
}

// Mechanism returns the kafka-go SASL mechanism, or nil for SASLNone.
func (s Security) Mechanism() (sasl.Mechanism, error) {
	switch m := SASLMechanism(s.SASLMechanism).Normalized(); m {
	case SASLNone:
		return nil, nil
	case SASLPlain:
		return plain.Mechanism{Username: s.SASLUsername, Password: s.SASLPassword}, nil
	case SASLScramSHA256, SASLScramSHA512:
		algo := scram.SHA256
		if m == SASLScramSHA512 {
			algo = scram.SHA512
		}
		mech, err := scram.Mechanism(algo, s.SASLUsername, s.SASLPassword)
		if err != nil {
			return nil, fmt.Errorf("bus: kafka SASL %s: %w", m, err)
		}
		return mech, nil
	default:
		return nil, fmt.Errorf("%w: unknown SASL mechanism %q", ErrInvalidConfig, s.SASLMechanism)
	}
}

// parts returns the TLS configuration and the SASL mechanism.
func (s Security) parts() (*tls.Config, sasl.Mechanism, error) {
	tc, err := s.TLSConfig()
	if err != nil {
		return nil, nil, err
	}
	mech, err := s.Mechanism()
	if err != nil {
		return nil, nil, err
	}
	return tc, mech, nil
}

// Transport returns a kafka-go transport (for a Writer or a Client) that
// connects with s's TLS and SASL; the caller may set its other fields and
// must call CloseIdleConnections when done with it.
func (s Security) Transport() (*kafka.Transport, error) {
	tc, mech, err := s.parts()
	if err != nil {
		return nil, err
	}
	return &kafka.Transport{TLS: tc, SASL: mech}, nil
}

// Dialer returns a kafka-go dialer (for a Reader) that connects with s's
// TLS and SASL, with kafka-go's default dial timeout.
func (s Security) Dialer() (*kafka.Dialer, error) {
	tc, mech, err := s.parts()
	if err != nil {
		return nil, err
	}
	return &kafka.Dialer{Timeout: securityDialTimeout, DualStack: true, TLS: tc, SASLMechanism: mech}, nil
}

// isZero reports whether s is plaintext without authentication.
func (s Security) isZero() bool {
	return !s.TLS && SASLMechanism(s.SASLMechanism).Normalized() == SASLNone
}

// String describes s with the password masked.
func (s Security) String() string {
	pw := ""
	if s.SASLPassword != "" {
		pw = "***"
	}
	return fmt.Sprintf("{TLS:%t CAFile:%q CertFile:%q KeyFile:%q ServerName:%q SASLMechanism:%s SASLUsername:%q SASLPassword:%s}",
		s.TLS, s.CAFile, s.CertFile, s.KeyFile, s.ServerName, SASLMechanism(s.SASLMechanism).Normalized(), s.SASLUsername, pw)
}

// LogValue logs s with the password left out.
func (s Security) LogValue() slog.Value {
	return slog.GroupValue(
		slog.Bool("tls", s.TLS), slog.String("ca_file", s.CAFile), slog.String("cert_file", s.CertFile),
		slog.String("server_name", s.ServerName), slog.String("sasl_mechanism", string(SASLMechanism(s.SASLMechanism).Normalized())),
		slog.String("sasl_username", s.SASLUsername), slog.Bool("sasl_password_set", s.SASLPassword != ""))
}

// SecurityOption carries a Security to NewProducer (as a ProducerOption)
// and to EnsureTopics, Ping and NewLagCollector (as a ClientOption).
type SecurityOption struct{ s Security }

// WithSecurity makes a producer, an admin call or a lag collector connect
// with s's TLS and SASL settings.
func WithSecurity(s Security) SecurityOption { return SecurityOption{s: s} }

func (o SecurityOption) applyProducer(c *producerConfig) { c.security = o.s }

func (o SecurityOption) applyClient(c *clientConfig) { c.security = o.s }

// ClientOption configures the clients of EnsureTopics, Ping and
// NewLagCollector; WithSecurity is one.
type ClientOption interface {
	applyClient(*clientConfig)
}

// clientConfig is what ClientOptions set.
type clientConfig struct {
	security Security
}

// newClientConfig applies opts.
func newClientConfig(opts []ClientOption) clientConfig {
	var c clientConfig
	for _, o := range opts {
		o.applyClient(&c)
	}
	return c
}

// adminClient returns a kafka-go client of brokers with c's security and
// its transport, whose idle connections the caller closes.
func (c clientConfig) adminClient(brokers []string) (*kafka.Client, *kafka.Transport, error) {
	transport, err := c.security.Transport()
	if err != nil {
		return nil, nil, err
	}
	return &kafka.Client{Addr: kafka.TCP(brokers...), Transport: transport, Timeout: adminTimeout}, transport, nil
}
