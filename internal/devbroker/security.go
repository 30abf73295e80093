package devbroker

import (
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"strings"

	"github.com/segmentio/kafka-go"

	"github.com/kvmesh/kvmesh/pkg/bus"
)

// SASLUser is one user the broker accepts when it requires SASL.
type SASLUser struct {
	// Mechanism is the mechanism the user authenticates with: bus.SASLPlain,
	// bus.SASLScramSHA256 or bus.SASLScramSHA512. A name may have a user of
	// each mechanism.
	Mechanism bus.SASLMechanism
	// Name is the username.
	Name string
	// Password is the user's password.
	Password string
}

// String describes u without its password.
func (u SASLUser) String() string {
	return string(u.Mechanism.Normalized()) + ":" + u.Name
}

// ParseSASLUsers parses a comma-separated list of MECHANISM:NAME:PASSWORD
// entries (the format of `kvmesh devbroker -sasl-users`), such as
// "scram-sha-256:kvmesh:secret,plain:admin:admin". A password may contain
// colons but not commas. The empty string is no users.
func ParseSASLUsers(s string) ([]SASLUser, error) {
	var users []SASLUser
	for entry := range strings.SplitSeq(s, ",") {
		entry = strings.TrimSpace(entry)
		if entry == "" {
			continue
		}
		parts := strings.SplitN(entry, ":", 3)
		if len(parts) != 3 {
			// The entry is not echoed: it may hold a password.
			return nil, fmt.Errorf("%w: SASL user %d: want MECHANISM:NAME:PASSWORD", ErrInvalidConfig, len(users)+1)
		}
		users = append(users, SASLUser{Mechanism: bus.SASLMechanism(parts[0]).Normalized(), Name: parts[1], Password: parts[2]})
	}
	return users, validateUsers(users)
}

// validateUsers checks that every user has a SASL mechanism, a name and a
// password, and that no mechanism and name repeat.
func validateUsers(users []SASLUser) error {
	seen := map[string]bool{}
	for i, u := range users {
		m := u.Mechanism.Normalized()
		switch {
		case !m.Known() || m == bus.SASLNone:
			return fmt.Errorf("%w: SASL user %d: mechanism %q is not plain, scram-sha-256 or scram-sha-512",
				ErrInvalidConfig, i+1, string(u.Mechanism))
		case u.Name == "" || u.Password == "":
			return fmt.Errorf("%w: SASL user %d (%s): empty name or password", ErrInvalidConfig, i+1, m)
		case seen[u.String()]:
			return fmt.Errorf("%w: SASL user %s given twice", ErrInvalidConfig, u)
		}
		seen[u.String()] = true
	}
	return nil
}

// serverTLS returns the listener's TLS configuration, or nil when TLS is
// off: TLS.CertFile and TLS.KeyFile are required together, and a client CA
// needs them.
func (c Config) serverTLS() (*tls.Config, error) {
	f := c.TLS
	if f.CertFile == "" && f.KeyFile == "" {
		if f.CAFile != "" {
			return nil, fmt.Errorf("%w: a TLS client CA needs a server certificate and key", ErrInvalidConfig)
		}
		return nil, nil
	}
	tc, err := f.Server()
	if err != nil {
		return nil, fmt.Errorf("%w: TLS: %w", ErrInvalidConfig, err)
	}
	return tc, nil
}

// errNotSelf means the broker's self-check reached a TLS server that is not
// this broker.
var errNotSelf = errors.New("devbroker: TLS peer is not this broker")

// selfTransport returns the transport of the start-up metadata check: over
// TLS it trusts exactly the broker's own certificate (whatever names it
// carries), and with SASL it authenticates as the first user.
func selfTransport(cfg Config, server *tls.Config) (*kafka.Transport, error) {
	t := &kafka.Transport{}
	if server != nil {
		own := server.Certificates[0].Certificate[0]
		t.TLS = &tls.Config{
			MinVersion: tls.VersionTLS12,
			// Verification is replaced, not skipped: the peer must present
			// the broker's own leaf certificate.
			InsecureSkipVerify: true,
			VerifyPeerCertificate: func(raw [][]byte, _ [][]*x509.Certificate) error {
				if len(raw) == 0 || !bytes.Equal(raw[0], own) {
					return errNotSelf
				}
				return nil
			},
		}
	}
	if len(cfg.SASLUsers) > 0 {
		u := cfg.SASLUsers[0]
		mech, err := bus.Security{SASLMechanism: string(u.Mechanism), SASLUsername: u.Name, SASLPassword: u.Password}.Mechanism()
		if err != nil {
			return nil, fmt.Errorf("devbroker: self-check SASL: %w", err)
		}
		t.SASL = mech
	}
	return t, nil
}
