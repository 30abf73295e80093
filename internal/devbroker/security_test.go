package devbroker_test

import (
	"context"
	"errors"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/internal/devbroker"
	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/tlsfiles"
)

func TestSecurityConfigValidate(t *testing.T) {
	certs := testenv.NewCerts(t)
	user := devbroker.SASLUser{Mechanism: bus.SASLScramSHA256, Name: "u", Password: "p"}
	tests := []validateCase{
		{"sasl users", devbroker.Config{SASLUsers: []devbroker.SASLUser{user,
			{Mechanism: "PLAIN", Name: "u", Password: "p"}}}, true},
		{"tls", devbroker.Config{TLS: tlsfiles.Files{CertFile: certs.ServerCert, KeyFile: certs.ServerKey}}, true},
		{"mutual tls", devbroker.Config{TLS: tlsfiles.Files{CertFile: certs.ServerCert, KeyFile: certs.ServerKey, CAFile: certs.CAFile}}, true},
		{"unknown mechanism", devbroker.Config{SASLUsers: []devbroker.SASLUser{{Mechanism: "gssapi", Name: "u", Password: "p"}}}, false},
		{"mechanism none", devbroker.Config{SASLUsers: []devbroker.SASLUser{{Mechanism: bus.SASLNone, Name: "u", Password: "p"}}}, false},
		{"empty name", devbroker.Config{SASLUsers: []devbroker.SASLUser{{Mechanism: bus.SASLPlain, Password: "p"}}}, false},
		{"empty password", devbroker.Config{SASLUsers: []devbroker.SASLUser{{Mechanism: bus.SASLPlain, Name: "u"}}}, false},
		{"duplicate user", devbroker.Config{SASLUsers: []devbroker.SASLUser{user, user}}, false},
		{"cert without key", devbroker.Config{TLS: tlsfiles.Files{CertFile: certs.ServerCert}}, false},
		{"key without cert", devbroker.Config{TLS: tlsfiles.Files{KeyFile: certs.ServerKey}}, false},
		{"client CA without cert", devbroker.Config{TLS: tlsfiles.Files{CAFile: certs.CAFile}}, false},
		{"unreadable cert", devbroker.Config{TLS: tlsfiles.Files{CertFile: filepath.Join(t.TempDir(), "no.pem"), KeyFile: certs.ServerKey}}, false},
	}
	checkValidate(t, tests)
}

func TestParseSASLUsers(t *testing.T) {
	tests := []struct {
		in   string
		want []devbroker.SASLUser
		ok   bool
	}{
		{"", nil, true},
		{"scram-sha-256:kvmesh:s3cret, PLAIN:admin:a:b:c", []devbroker.SASLUser{
			{Mechanism: bus.SASLScramSHA256, Name: "kvmesh", Password: "s3cret"},
			{Mechanism: bus.SASLPlain, Name: "admin", Password: "a:b:c"},
		}, true},
		{"plain:admin", nil, false},
		{"kerberos:a:b", nil, false},
		{"plain:a:b,plain:a:c", nil, false},
	}
	for _, tt := range tests {
		t.Run(tt.in, func(t *testing.T) {
			got, err := devbroker.ParseSASLUsers(tt.in)
			if !tt.ok {
				if !errors.Is(err, devbroker.ErrInvalidConfig) {
					t.Fatalf("ParseSASLUsers = %v, %v; want ErrInvalidConfig", got, err)
				}
				if strings.Contains(err.Error(), "admin") && strings.Contains(tt.in, "admin") {
					t.Errorf("the error echoes the entry: %v", err)
				}
				return
			}
			if err != nil || !reflect.DeepEqual(got, tt.want) {
				t.Fatalf("ParseSASLUsers = %+v, %v; want %+v", got, err, tt.want)
			}
		})
	}
}

func TestStartRequiresTLSAndSASL(t *testing.T) {
	certs := testenv.NewCerts(t)
	tests := []struct {
		name string
		tls  tlsfiles.Files
	}{
		{"tls and sasl", tlsfiles.Files{CertFile: certs.ServerCert, KeyFile: certs.ServerKey}},
		// With mutual TLS Start checks its topics in process (it has no
		// client certificate of its own).
		{"mutual tls and sasl", tlsfiles.Files{CertFile: certs.ServerCert, KeyFile: certs.ServerKey, CAFile: certs.CAFile}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			u := devbroker.SASLUser{Mechanism: bus.SASLScramSHA512, Name: "kvmesh", Password: "broker-secret"}
			b := start(t, devbroker.Config{Addr: "127.0.0.1:0", Partitions: 1, SASLUsers: []devbroker.SASLUser{u}, TLS: tt.tls})
			good := bus.Security{TLS: true, CAFile: certs.CAFile, SASLMechanism: string(u.Mechanism), SASLUsername: u.Name, SASLPassword: u.Password}
			if tt.tls.CAFile != "" {
				good.CertFile, good.KeyFile = certs.ClientCert, certs.ClientKey
			}
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			if err := bus.Ping(ctx, b.Addrs(), bus.WithSecurity(good)); err != nil {
				t.Fatalf("Ping with TLS and SASL: %v", err)
			}
			if err := bus.Ping(ctx, b.Addrs()); err == nil {
				t.Fatal("a plaintext client without SASL was served")
			}
			noSASL := good
			noSASL.SASLMechanism, noSASL.SASLUsername, noSASL.SASLPassword = "", "", ""
			if err := bus.Ping(ctx, b.Addrs(), bus.WithSecurity(noSASL)); err == nil {
				t.Fatal("a TLS client without SASL was served")
			}
		})
	}
}
