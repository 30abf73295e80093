package testenv

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// Certs are PEM files of a test certificate authority and of a server and
// a client certificate it signed, for TLS against real servers on
// loopback: the server's names are localhost, 127.0.0.1 and ::1.
type Certs struct {
	// Dir holds every file.
	Dir string
	// CAFile is the authority's certificate.
	CAFile string
	// ServerCert and ServerKey are the server's certificate and key.
	ServerCert, ServerKey string
	// ClientCert and ClientKey are a client's (CN kvmesh-test-client).
	ClientCert, ClientKey string
	// OtherCAFile is a second authority that signed nothing above: a
	// client that trusts only it must refuse the server.
	OtherCAFile string
}

// NewCerts writes a fresh Certs into a temporary directory of t.
func NewCerts(t testing.TB) *Certs {
	t.Helper()
	dir := t.TempDir()
	c := &Certs{Dir: dir}
	ca, caKey := newCA(t, "kvmesh-test-ca")
	c.CAFile = writePEM(t, dir, "ca.pem", "CERTIFICATE", ca.Raw)
	other, _ := newCA(t, "kvmesh-other-ca")
	c.OtherCAFile = writePEM(t, dir, "other-ca.pem", "CERTIFICATE", other.Raw)
	c.ServerCert, c.ServerKey = leaf(t, dir, "server", ca, caKey, x509.ExtKeyUsageServerAuth, "localhost")
	c.ClientCert, c.ClientKey = leaf(t, dir, "client", ca, caKey, x509.ExtKeyUsageClientAuth, "kvmesh-test-client")
	return c
}

func newCA(t testing.TB, cn string) (*x509.Certificate, *ecdsa.PrivateKey) {
	t.Helper()
	key := newKey(t)
	tmpl := &x509.Certificate{
		SerialNumber: serial(t), Subject: pkix.Name{CommonName: cn},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return cert, key
}

// leaf writes a certificate signed by ca and its key as NAME.pem and
// NAME-key.pem.
func leaf(t testing.TB, dir, name string, ca *x509.Certificate, caKey *ecdsa.PrivateKey, usage x509.ExtKeyUsage, cn string) (certFile, keyFile string) {
	t.Helper()
	key := newKey(t)
	tmpl := &x509.Certificate{
		SerialNumber: serial(t), Subject: pkix.Name{CommonName: cn},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment, ExtKeyUsage: []x509.ExtKeyUsage{usage},
		DNSNames: []string{"localhost"}, IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	kb, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	return writePEM(t, dir, name+".pem", "CERTIFICATE", der), writePEM(t, dir, name+"-key.pem", "PRIVATE KEY", kb)
}

func newKey(t testing.TB) *ecdsa.PrivateKey {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	return key
}

func serial(t testing.TB) *big.Int {
	t.Helper()
	n, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 62))
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// writePEM writes one PEM block, readable by other users too (a server
// such as PostgreSQL may run as its own user; its key must then be
// chowned or copied by the test that starts it).
func writePEM(t testing.TB, dir, name, kind string, der []byte) string {
	t.Helper()
	path := filepath.Join(dir, name)
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: kind, Bytes: der}), 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}
