package kvstore

import (
	"crypto/tls"
	"errors"
	"fmt"
	"net/url"

	"github.com/kvmesh/kvmesh/pkg/tlsfiles"
)

// RedisTLS names the PEM files and the server name of the store pool's TLS
// connections, for a rediss:// or rediss+cluster:// URL. It is the one place
// these settings are declared: the services embed it in their Config, and
// RedisOptions.TLS carries it to every client of the store (go-redis's,
// single server and cluster, the store's own EXISTS/GET connections and the
// sender's watcher of keyspace notifications). The zero value keeps
// go-redis's defaults: the system roots, no client certificate and the
// URL's (first) host as the server name.
type RedisTLS struct {
	// CAFile is a PEM bundle that verifies the server's certificate
	// instead of the system roots.
	CAFile string `env:"KVMESH_REDIS_CA_FILE" doc:"PEM CA bundle that verifies the store pool's certificate with a rediss:// URL (default: the system roots)"`
	// CertFile and KeyFile are the client certificate and key presented
	// to a server that asks for one (Redis's tls-auth-clients yes).
	CertFile string `env:"KVMESH_REDIS_CERT_FILE" doc:"PEM client certificate presented to the store pool (mutual TLS, with KVMESH_REDIS_KEY_FILE)"`
	KeyFile  string `env:"KVMESH_REDIS_KEY_FILE" doc:"PEM private key of KVMESH_REDIS_CERT_FILE"`
	// ServerName, when set, is the name checked against the server's
	// certificate instead of the URL's host (of its first seed node for a
	// cluster, whose every node is checked against that one name).
	ServerName string `env:"KVMESH_REDIS_SERVER_NAME" doc:"name checked against the store pool's certificate instead of the URL's host (for a cluster: of its first seed node, which every node's certificate must carry)"`
}

// IsZero reports whether no setting is given.
func (t RedisTLS) IsZero() bool { return t == RedisTLS{} }

// files is t as tlsfiles' description of a TLS client.
func (t RedisTLS) files() tlsfiles.Files {
	return tlsfiles.Files{CAFile: t.CAFile, CertFile: t.CertFile, KeyFile: t.KeyFile, ServerName: t.ServerName}
}

// config returns the TLS configuration of a client whose URL go-redis
// parsed into parsed (nil for a plain redis:// URL): parsed itself when no
// setting is given, else the configuration t describes, with parsed's
// server name when t names none and parsed's skip_verify. Settings for a
// plain URL are an error (errTLSPlain) rather than ignored, so that a
// deployment that meant TLS does not silently go without.
func (t RedisTLS) config(parsed *tls.Config) (*tls.Config, error) {
	switch {
	case t.IsZero():
		return parsed, nil
	case parsed == nil:
		return nil, errTLSPlain
	}
	cfg, err := t.files().Client()
	if err != nil {
		return nil, err
	}
	if cfg.ServerName == "" {
		cfg.ServerName = parsed.ServerName
	}
	cfg.InsecureSkipVerify = parsed.InsecureSkipVerify
	return cfg, nil
}

// urlError drops the URL from a net/url parse error, whose text quotes the
// whole URL, password included; the cause stays reachable with errors.As.
func urlError(err error) error {
	var ue *url.Error
	if !errors.As(err, &ue) {
		return err
	}
	return &redactedURLError{err: ue}
}

// redactedURLError is a *url.Error shown without its URL.
type redactedURLError struct{ err *url.Error }

// Error returns the operation and the cause, without the URL.
func (e *redactedURLError) Error() string {
	return fmt.Sprintf("%s url: %v", e.err.Op, e.err.Err)
}

// Unwrap returns the *url.Error.
func (e *redactedURLError) Unwrap() error { return e.err }
