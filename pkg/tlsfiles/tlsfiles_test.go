package tlsfiles_test

import (
	"crypto/tls"
	"errors"
	"io"
	"net"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/tlsfiles"
)

// handshake runs one TLS handshake over loopback between a server and a
// client configuration and returns the client's error.
func handshake(t *testing.T, server, client *tls.Config) error {
	t.Helper()
	ln, err := tls.Listen("tcp", "127.0.0.1:0", server)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		_ = c.(*tls.Conn).Handshake()
		_, _ = io.Copy(io.Discard, c)
		_ = c.Close()
	}()
	c, err := tls.Dial("tcp", ln.Addr().String(), client)
	if err != nil {
		return err
	}
	defer c.Close()
	// With TLS 1.3 a refused client certificate shows on the first read.
	_ = c.SetDeadline(deadline())
	_, err = c.Read(make([]byte, 1))
	if err == io.EOF || isTimeout(err) {
		return nil
	}
	return err
}

func TestHandshakes(t *testing.T) {
	c := testenv.NewCerts(t)
	server := tlsfiles.Files{CertFile: c.ServerCert, KeyFile: c.ServerKey}
	mutual := tlsfiles.Files{CertFile: c.ServerCert, KeyFile: c.ServerKey, CAFile: c.CAFile}
	for _, tc := range []struct {
		name           string
		server, client tlsfiles.Files
		ok             bool
	}{
		{"verified", server, tlsfiles.Files{CAFile: c.CAFile}, true},
		{"unknown authority", server, tlsfiles.Files{CAFile: c.OtherCAFile}, false},
		{"wrong name", server, tlsfiles.Files{CAFile: c.CAFile, ServerName: "db.example"}, false},
		{"mutual", mutual, tlsfiles.Files{CAFile: c.CAFile, CertFile: c.ClientCert, KeyFile: c.ClientKey}, true},
		{"mutual without client cert", mutual, tlsfiles.Files{CAFile: c.CAFile}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, err := tc.server.Server()
			if err != nil {
				t.Fatal(err)
			}
			cl, err := tc.client.Client()
			if err != nil {
				t.Fatal(err)
			}
			if err := handshake(t, s, cl); (err == nil) != tc.ok {
				t.Fatalf("handshake error %v, want ok=%v", err, tc.ok)
			}
		})
	}
}

func TestBadFiles(t *testing.T) {
	c := testenv.NewCerts(t)
	if _, err := (tlsfiles.Files{CertFile: c.ServerCert}).Client(); !errors.Is(err, tlsfiles.ErrIncomplete) {
		t.Errorf("cert without key: %v, want ErrIncomplete", err)
	}
	if _, err := (tlsfiles.Files{}).Server(); !errors.Is(err, tlsfiles.ErrNoServerCert) {
		t.Errorf("server without cert: %v, want ErrNoServerCert", err)
	}
	if _, err := (tlsfiles.Files{CAFile: c.ServerKey}).Client(); !errors.Is(err, tlsfiles.ErrNoCertificates) {
		t.Errorf("key as CA: %v, want ErrNoCertificates", err)
	}
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

func deadline() time.Time { return time.Now().Add(200 * time.Millisecond) }
