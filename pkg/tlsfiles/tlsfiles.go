// Package tlsfiles builds the TLS configurations of kvmesh's clients and
// servers (HTTP, Kafka, Redis) from PEM files named in the configuration:
// a CA bundle to verify the peer, and a certificate and key to present.
// Every configuration it returns requires TLS 1.2 or later.
package tlsfiles

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
)

// Errors of Client and Server.
var (
	// ErrIncomplete means a certificate was named without its key, or a
	// key without its certificate.
	ErrIncomplete = errors.New("tlsfiles: a certificate needs its key and a key its certificate")
	// ErrNoCertificates means a CA file held no PEM certificate.
	ErrNoCertificates = errors.New("tlsfiles: no PEM certificate in the CA file")
	// ErrNoServerCert means a server was configured without a certificate.
	ErrNoServerCert = errors.New("tlsfiles: a TLS server needs a certificate and key")
)

// Files names the PEM files of one TLS endpoint. Empty fields are unused.
type Files struct {
	// CAFile verifies the peer: a client checks the server's certificate
	// against it (the system roots when empty); a server with CAFile set
	// asks for and verifies client certificates (mutual TLS).
	CAFile string
	// CertFile and KeyFile are the certificate (chain) and private key
	// this side presents: a server's own, or a client's for mutual TLS.
	CertFile, KeyFile string
	// ServerName, on a client, is the name checked against the server's
	// certificate when it is not the host dialled.
	ServerName string
}

// Client returns the configuration of a client that verifies the server
// against CAFile (or the system roots) and, with CertFile and KeyFile,
// presents its own certificate.
func (f Files) Client() (*tls.Config, error) {
	cfg := &tls.Config{MinVersion: tls.VersionTLS12, ServerName: f.ServerName}
	if f.CAFile != "" {
		pool, err := loadPool(f.CAFile)
		if err != nil {
			return nil, err
		}
		cfg.RootCAs = pool
	}
	cert, ok, err := f.keyPair()
	if err != nil {
		return nil, err
	}
	if ok {
		cfg.Certificates = []tls.Certificate{cert}
	}
	return cfg, nil
}

// Server returns the configuration of a server presenting CertFile and
// KeyFile; with CAFile set every client must present a certificate that
// CAFile verifies.
func (f Files) Server() (*tls.Config, error) {
	cert, ok, err := f.keyPair()
	if err != nil {
		return nil, err
	}
	if !ok {
		return nil, ErrNoServerCert
	}
	cfg := &tls.Config{MinVersion: tls.VersionTLS12, Certificates: []tls.Certificate{cert}}
	if f.CAFile != "" {
		pool, err := loadPool(f.CAFile)
		if err != nil {
			return nil, err
		}
		cfg.ClientCAs, cfg.ClientAuth = pool, tls.RequireAndVerifyClientCert
	}
	return cfg, nil
}

// keyPair loads CertFile and KeyFile; ok is false when neither is set.
func (f Files) keyPair() (cert tls.Certificate, ok bool, err error) {
	switch {
	case f.CertFile == "" && f.KeyFile == "":
		return tls.Certificate{}, false, nil
	case f.CertFile == "" || f.KeyFile == "":
		return tls.Certificate{}, false, ErrIncomplete
	}
	cert, err = tls.LoadX509KeyPair(f.CertFile, f.KeyFile)
	if err != nil {
		return tls.Certificate{}, false, fmt.Errorf("tlsfiles: load %s and its key: %w", f.CertFile, err)
	}
	return cert, true, nil
}

// loadPool reads a PEM CA bundle.
func loadPool(path string) (*x509.CertPool, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("tlsfiles: CA file: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(b) {
		return nil, fmt.Errorf("%w: %s", ErrNoCertificates, path)
	}
	return pool, nil
}
