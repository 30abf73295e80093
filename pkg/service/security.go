package service

import (
	"crypto/tls"
	"fmt"
	"net/http"

	"github.com/kvmesh/kvmesh/pkg/auth"
	"github.com/kvmesh/kvmesh/pkg/tlsfiles"
)

// HTTPTLS is the TLS of a service's HTTP server and of the HTTP clients
// it uses to call other services. Everything is off when no file is set.
type HTTPTLS struct {
	// CertFile and KeyFile are the server's certificate and key; set, the
	// service serves HTTPS only.
	CertFile string `env:"KVMESH_HTTP_TLS_CERT_FILE" doc:"PEM certificate (chain) of the service's HTTPS server; with KVMESH_HTTP_TLS_KEY_FILE the service serves HTTPS only"`
	KeyFile  string `env:"KVMESH_HTTP_TLS_KEY_FILE" doc:"PEM private key of the service's HTTPS server"`
	// ClientCAFile makes the server require client certificates it
	// verifies (mutual TLS).
	ClientCAFile string `env:"KVMESH_HTTP_TLS_CLIENT_CA_FILE" doc:"PEM CA bundle: when set, the HTTPS server requires and verifies client certificates (mutual TLS)"`
	// CAFile verifies the services this one calls over HTTPS (the system
	// roots when empty).
	CAFile string `env:"KVMESH_HTTP_CA_FILE" doc:"PEM CA bundle that verifies the HTTPS services this one calls (gpuworkers' data plane); the system roots when unset"`
	// ClientCertFile and ClientKeyFile are presented to services that
	// require client certificates.
	ClientCertFile string `env:"KVMESH_HTTP_CLIENT_CERT_FILE" doc:"PEM client certificate this service presents to HTTPS services that require one (mutual TLS)"`
	ClientKeyFile  string `env:"KVMESH_HTTP_CLIENT_KEY_FILE" doc:"PEM key of KVMESH_HTTP_CLIENT_CERT_FILE"`
}

// Server returns the HTTPS server configuration, or nil when the service
// serves plain HTTP.
func (t HTTPTLS) Server() (*tls.Config, error) {
	if t.CertFile == "" && t.KeyFile == "" && t.ClientCAFile == "" {
		return nil, nil
	}
	cfg, err := tlsfiles.Files{CertFile: t.CertFile, KeyFile: t.KeyFile, CAFile: t.ClientCAFile}.Server()
	if err != nil {
		return nil, fmt.Errorf("KVMESH_HTTP_TLS_*: %w", err)
	}
	return cfg, nil
}

// Client returns the configuration of the service's HTTPS clients.
func (t HTTPTLS) Client() (*tls.Config, error) {
	cfg, err := tlsfiles.Files{CAFile: t.CAFile, CertFile: t.ClientCertFile, KeyFile: t.ClientKeyFile}.Client()
	if err != nil {
		return nil, fmt.Errorf("KVMESH_HTTP_CA_FILE / KVMESH_HTTP_CLIENT_*: %w", err)
	}
	return cfg, nil
}

// validate loads every file once, so that a bad one stops the service at
// start with its setting named.
func (t HTTPTLS) validate() error {
	if _, err := t.Server(); err != nil {
		return err
	}
	_, err := t.Client()
	return err
}

// ServiceTransport returns base (an *http.Transport, cloned) set up for
// calls from the service named service to other kvmesh services: the
// HTTPS client configuration and, when authentication is required, a
// service token minted from the auth key on every request.
func (c *Common) ServiceTransport(service string, base *http.Transport) (http.RoundTripper, error) {
	tr := base.Clone()
	cfg, err := c.HTTPTLS.Client()
	if err != nil {
		return nil, err
	}
	tr.TLSClientConfig = cfg
	if !c.Auth.Required() {
		return tr, nil
	}
	k, err := auth.NewKey(c.Auth.Key)
	if err != nil {
		return nil, err
	}
	return auth.Transport(tr, auth.ServiceTokens(k, service)), nil
}
