package main

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/internal/devbroker"
	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/bus"
)

func TestDevbrokerConfigSecurity(t *testing.T) {
	quiet(t)
	certs := testenv.NewCerts(t)
	t.Setenv("KVMESH_BROKER_SASL_USERS", "scram-sha-512:kvmesh:env-secret")
	t.Setenv("KVMESH_BROKER_TLS_CERT_FILE", certs.ServerCert)
	t.Setenv("KVMESH_BROKER_TLS_KEY_FILE", certs.ServerKey)
	cfg, err := devbrokerConfig([]string{"-addr", "127.0.0.1:0", "-tls-client-ca", certs.CAFile})
	if err != nil {
		t.Fatalf("devbrokerConfig: %v", err)
	}
	want := []devbroker.SASLUser{{Mechanism: bus.SASLScramSHA512, Name: "kvmesh", Password: "env-secret"}}
	if len(cfg.SASLUsers) != 1 || cfg.SASLUsers[0] != want[0] {
		t.Errorf("SASL users %+v, want %+v", cfg.SASLUsers, want)
	}
	if cfg.TLS.CertFile != certs.ServerCert || cfg.TLS.KeyFile != certs.ServerKey || cfg.TLS.CAFile != certs.CAFile {
		t.Errorf("TLS %+v", cfg.TLS)
	}
}

func TestDevbrokerConfigSecurityErrors(t *testing.T) {
	quiet(t)
	certs := testenv.NewCerts(t)
	tests := []struct {
		name string
		args []string
	}{
		{"sasl user without password", []string{"-sasl-users", "plain:admin"}},
		{"unknown mechanism", []string{"-sasl-users", "gssapi:a:b"}},
		{"cert without key", []string{"-tls-cert", certs.ServerCert}},
		{"client CA without cert", []string{"-tls-client-ca", certs.CAFile}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if _, err := devbrokerConfig(tt.args); !errors.Is(err, errUsage) && !errors.Is(err, devbroker.ErrInvalidConfig) {
				t.Fatalf("devbrokerConfig(%q) = %v, want a usage or config error", tt.args, err)
			}
		})
	}
}

func TestRunDevbrokerWithTLSAndSASL(t *testing.T) {
	certs := testenv.NewCerts(t)
	logs := &testenv.SyncBuffer{}
	old := stderr
	stderr = logs
	t.Cleanup(func() { stderr = old })
	t.Setenv("KVMESH_BROKER_SASL_USERS", "scram-sha-256:kvmesh:cli-broker-secret")
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- runDevbroker(ctx, []string{"-addr", "127.0.0.1:0", "-partitions", "1",
			"-tls-cert", certs.ServerCert, "-tls-key", certs.ServerKey})
	}()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("runDevbroker: %v", err)
		}
	}()
	deadline := time.Now().Add(15 * time.Second)
	for !strings.Contains(logs.String(), "broker ready") {
		if time.Now().After(deadline) {
			t.Fatalf("no broker ready line; log:\n%s", logs.String())
		}
		select {
		case err := <-done:
			t.Fatalf("runDevbroker returned early: %v", err)
		case <-time.After(10 * time.Millisecond):
		}
	}
	log := logs.String()
	if strings.Contains(log, "cli-broker-secret") {
		t.Errorf("the log shows a SASL password:\n%s", log)
	}
	if !strings.Contains(log, `"tls":true`) || !strings.Contains(log, "scram-sha-256:kvmesh") {
		t.Errorf("the ready line does not describe TLS and the SASL user:\n%s", log)
	}
	addr := brokerReadyAddr(t, log)
	sec := bus.Security{TLS: true, CAFile: certs.CAFile, SASLMechanism: bus.SASLScramSHA256,
		SASLUsername: "kvmesh", SASLPassword: "cli-broker-secret"}
	pctx, pcancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer pcancel()
	if err := bus.Ping(pctx, []string{addr}, bus.WithSecurity(sec)); err != nil {
		t.Fatalf("Ping with TLS and SASL: %v", err)
	}
	if err := bus.Ping(pctx, []string{addr}); err == nil {
		t.Fatal("the broker served a plaintext client")
	}
}

// brokerReadyAddr returns the addr of the "broker ready" log line.
func brokerReadyAddr(t *testing.T, log string) string {
	t.Helper()
	_, rest, ok := strings.Cut(log, `"addr":"`)
	if !ok {
		t.Fatalf("no addr in the log:\n%s", log)
	}
	addr, _, _ := strings.Cut(rest, `"`)
	return addr
}
