package testenv_test

import (
	"crypto/tls"
	"crypto/x509"
	"net"
	"net/url"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/internal/testenv"
)

// TestStartTLSRedisSpeaksTLSOnly: the server answers no plain command on
// its port, completes a handshake only with a client that trusts the test
// CA (and, with ClientCerts, presents the client certificate), and its URL
// names the ACL user.
func TestStartTLSRedisSpeaksTLSOnly(t *testing.T) {
	certs := testenv.NewCerts(t)
	for _, mtls := range []bool{false, true} {
		srv := testenv.StartTLSRedis(t, certs, testenv.TLSRedisOptions{ClientCerts: mtls})
		if lines, err := command(srv.Addr(), "PING", 1); err == nil {
			t.Errorf("mTLS %v: a plain PING was answered %q", mtls, lines)
		}
		u, err := url.Parse(srv.URL())
		if err != nil {
			t.Fatal(err)
		}
		if pw, _ := u.User.Password(); u.Scheme != "rediss" || u.User.Username() != srv.User || pw != srv.Password || u.Host != srv.Addr() {
			t.Errorf("URL %q does not name the server and its ACL user", srv.URL())
		}
		for _, tc := range []struct {
			name string
			ca   string
			cert bool
			ok   bool
		}{
			{"test CA", certs.CAFile, mtls, true},
			{"other CA", certs.OtherCAFile, mtls, false},
			{"no client certificate", certs.CAFile, false, !mtls},
		} {
			if err := handshake(srv.Addr(), certs, tc.ca, tc.cert); (err == nil) != tc.ok {
				t.Errorf("mTLS %v, %s: handshake error %v, want success %v", mtls, tc.name, err, tc.ok)
			}
		}
	}
}

// handshake opens a TLS connection to addr trusting caFile, presenting
// the test client certificate when cert is set, and reads one byte so that
// a server's refusal of the client certificate (sent after the handshake
// in TLS 1.3) is seen.
func handshake(addr string, certs *testenv.Certs, caFile string, cert bool) error {
	pem, err := os.ReadFile(caFile)
	if err != nil {
		return err
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(pem)
	cfg := &tls.Config{RootCAs: pool, ServerName: "127.0.0.1", MinVersion: tls.VersionTLS12}
	if cert {
		kp, err := tls.LoadX509KeyPair(certs.ClientCert, certs.ClientKey)
		if err != nil {
			return err
		}
		cfg.Certificates = []tls.Certificate{kp}
	}
	c, err := tls.DialWithDialer(&net.Dialer{Timeout: 2 * time.Second}, "tcp", addr, cfg)
	if err != nil {
		return err
	}
	defer c.Close()
	if err := c.SetDeadline(time.Now().Add(2 * time.Second)); err != nil {
		return err
	}
	if _, err := c.Write([]byte("PING\r\n")); err != nil {
		return err
	}
	_, err = c.Read(make([]byte, 1))
	return err
}

// TestStartTLSPostgresRefusesPlainConnections: psql (when installed)
// reaches the server over TLS with verify-full against the test CA and is
// refused without TLS.
func TestStartTLSPostgresRefusesPlainConnections(t *testing.T) {
	certs := testenv.NewCerts(t)
	pg := testenv.StartTLSPostgres(t, certs)
	psql, err := exec.LookPath("psql")
	if err != nil {
		t.Skip("psql is not on PATH")
	}
	out, err := exec.Command(psql, pg.URL("verify-full", certs.CAFile), "-Atqc", "select ssl from pg_stat_ssl where pid = pg_backend_pid()").CombinedOutput()
	if err != nil || strings.TrimSpace(string(out)) != "t" {
		t.Errorf("psql verify-full: %v: %s", err, out)
	}
	out, err = exec.Command(psql, pg.URL("disable", ""), "-Atqc", "select 1").CombinedOutput()
	if err == nil || !strings.Contains(string(out), "no encryption") {
		t.Errorf("psql without TLS: %v: %s; want the no-encryption refusal", err, out)
	}
}
