package testenv

import (
	"bufio"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// TLSRedisUser is the name of the ACL user of a TLSRedisServer.
const TLSRedisUser = "kvmesh"

// TLSRedisOptions configures StartTLSRedis.
type TLSRedisOptions struct {
	// ClientCerts makes the server require a client certificate that the
	// test CA signed (tls-auth-clients yes: mutual TLS); without it the
	// server asks for none (tls-auth-clients no).
	ClientCerts bool
}

// TLSRedisServer is a private redis-server that StartTLSRedis started for
// one test: TLS only (no plain port), with the certificate of Certs, the
// default user off and one ACL user, TLSRedisUser, allowed everything.
type TLSRedisServer struct {
	*serverProcess
	// Certs are the server's certificate and the CA that signed it.
	Certs *Certs
	// User and Password are the ACL user's credentials.
	User, Password string
}

// StartTLSRedis starts `redis-server --port 0 --tls-port N --bind
// 127.0.0.1` with the server certificate of certs, the default user off and
// the ACL user TLSRedisUser with a random password, no persistence, then
// args; it waits until the server answers PING over TLS as that user and
// kills it when the test ends. Without redis-server on PATH the test is
// skipped, or fails when KVMESH_REQUIRE_SERVICES=1; a redis-server built
// without TLS (Debian's has it) fails the start with its own message.
func StartTLSRedis(t testing.TB, certs *Certs, opts TLSRedisOptions, args ...string) *TLSRedisServer {
	t.Helper()
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		unavailable(t, "redis-server is not on PATH (%v); install redis-server", err)
	}
	s := &TLSRedisServer{Certs: certs, User: TLSRedisUser, Password: randomHex(t, 16)}
	clientCfg, err := s.clientConfig(opts.ClientCerts)
	if err != nil {
		t.Fatalf("redis-server (tls): client configuration: %v", err)
	}
	auth := "no"
	if opts.ClientCerts {
		auth = "yes"
	}
	dir := t.TempDir()
	launch := func(int) (*serverProcess, error) {
		port, err := freePort()
		if err != nil {
			return nil, err
		}
		base := []string{
			"--port", "0", "--tls-port", port, "--bind", "127.0.0.1",
			"--save", "", "--appendonly", "no", "--dir", dir,
			"--tls-cert-file", certs.ServerCert, "--tls-key-file", certs.ServerKey,
			"--tls-ca-cert-file", certs.CAFile, "--tls-auth-clients", auth,
			"--user", "default", "off",
			"--user", s.User, "on", ">" + s.Password, "~*", "&*", "+@all",
		}
		return launchServer("redis-server (tls)", bin, net.JoinHostPort("127.0.0.1", port), append(base, args...))
	}
	s.serverProcess = startServer(t, launch, func(p *serverProcess) error {
		return tlsPing(p.addr, clientCfg, s.User, s.Password)
	})
	return s
}

// URL returns the server's rediss:// URL for database 0 with the ACL
// user's credentials.
func (s *TLSRedisServer) URL() string {
	return s.URLAs(s.User, s.Password)
}

// URLAs returns the server's rediss:// URL for database 0 with the given
// credentials (a wrong password, say).
func (s *TLSRedisServer) URLAs(user, password string) string {
	u := url.URL{Scheme: "rediss", User: url.UserPassword(user, password), Host: s.addr, Path: "/0"}
	return u.String()
}

// clientConfig is the TLS configuration of a client that trusts the test
// CA and, with cert, presents the test client certificate.
func (s *TLSRedisServer) clientConfig(cert bool) (*tls.Config, error) {
	pem, err := os.ReadFile(s.Certs.CAFile)
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("no certificate in %s", s.Certs.CAFile)
	}
	cfg := &tls.Config{RootCAs: pool, ServerName: "127.0.0.1", MinVersion: tls.VersionTLS12}
	if cert {
		kp, err := tls.LoadX509KeyPair(s.Certs.ClientCert, s.Certs.ClientKey)
		if err != nil {
			return nil, err
		}
		cfg.Certificates = []tls.Certificate{kp}
	}
	return cfg, nil
}

// tlsPing authenticates as user over a fresh TLS connection to addr and
// expects +OK to AUTH and +PONG to PING.
func tlsPing(addr string, cfg *tls.Config, user, password string) error {
	d := &net.Dialer{Timeout: time.Second}
	c, err := tls.DialWithDialer(d, "tcp", addr, cfg)
	if err != nil {
		return err
	}
	defer c.Close()
	if err := c.SetDeadline(time.Now().Add(time.Second)); err != nil {
		return err
	}
	cmd := fmt.Sprintf("*3\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n*1\r\n$4\r\nPING\r\n", len(user), user, len(password), password)
	if _, err := c.Write([]byte(cmd)); err != nil {
		return err
	}
	r := bufio.NewReader(c)
	for _, want := range []string{"+OK", "+PONG"} {
		line, err := r.ReadString('\n')
		if err != nil {
			return err
		}
		if reply := strings.TrimSpace(line); reply != want {
			return fmt.Errorf("redis-server answered %q, want %q", reply, want)
		}
	}
	return nil
}

// randomHex returns n random bytes in hex, for passwords.
func randomHex(t testing.TB, n int) string {
	t.Helper()
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		t.Fatalf("random: %v", err)
	}
	return hex.EncodeToString(b)
}
