package bus_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/internal/devbroker"
	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/tlsfiles"
)

// refuseLimit bounds each call a refused client makes: it must fail within
// it, not hang.
const refuseLimit = 5 * time.Second

func TestSecurityValidate(t *testing.T) {
	certs := testenv.NewCerts(t)
	missing := filepath.Join(t.TempDir(), "missing.pem")
	tests := []struct {
		name string
		s    bus.Security
		want string // substring of the error; "" for valid
	}{
		{"zero value", bus.Security{}, ""},
		{"none spelled out", bus.Security{SASLMechanism: bus.SASLNone}, ""},
		{"plain", bus.Security{SASLMechanism: bus.SASLPlain, SASLUsername: "u", SASLPassword: "pw-secret-1"}, ""},
		{"kafka spelling", bus.Security{SASLMechanism: "SCRAM-SHA-512", SASLUsername: "u", SASLPassword: "pw-secret-1"}, ""},
		{"tls with CA and client cert", bus.Security{TLS: true, CAFile: certs.CAFile, CertFile: certs.ClientCert, KeyFile: certs.ClientKey}, ""},
		{"tls with system roots", bus.Security{TLS: true, ServerName: "kafka.example"}, ""},
		{"unknown mechanism", bus.Security{SASLMechanism: "gssapi", SASLUsername: "u", SASLPassword: "pw-secret-1"}, "KVMESH_KAFKA_SASL_MECHANISM \"gssapi\""},
		{"mechanism without username", bus.Security{SASLMechanism: bus.SASLScramSHA256, SASLPassword: "pw-secret-1"}, "needs KVMESH_KAFKA_SASL_USERNAME"},
		{"mechanism without password", bus.Security{SASLMechanism: bus.SASLScramSHA256, SASLUsername: "u"}, "needs KVMESH_KAFKA_SASL_PASSWORD"},
		{"credentials without mechanism", bus.Security{SASLUsername: "u", SASLPassword: "pw-secret-1"}, "KVMESH_KAFKA_SASL_MECHANISM is none"},
		{"CA file without tls", bus.Security{CAFile: certs.CAFile}, "KVMESH_KAFKA_CA_FILE is set but KVMESH_KAFKA_TLS"},
		{"server name without tls", bus.Security{ServerName: "x"}, "KVMESH_KAFKA_SERVER_NAME is set but KVMESH_KAFKA_TLS"},
		{"cert without key", bus.Security{TLS: true, CertFile: certs.ClientCert}, "KVMESH_KAFKA_CERT_FILE needs KVMESH_KAFKA_KEY_FILE"},
		{"key without cert", bus.Security{TLS: true, KeyFile: certs.ClientKey}, "KVMESH_KAFKA_KEY_FILE needs KVMESH_KAFKA_CERT_FILE"},
		{"unreadable CA file", bus.Security{TLS: true, CAFile: missing}, "missing.pem"},
		{"CA file without certificates", bus.Security{TLS: true, CAFile: certs.ClientKey}, "no PEM certificate"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.s.Validate()
			if tt.want == "" {
				if err != nil {
					t.Fatalf("Validate: %v", err)
				}
				return
			}
			if err == nil || !errors.Is(err, bus.ErrInvalidConfig) || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("Validate = %v, want ErrInvalidConfig containing %q", err, tt.want)
			}
			if strings.Contains(err.Error(), tt.s.SASLPassword) && tt.s.SASLPassword != "" {
				t.Errorf("the error shows the password: %v", err)
			}
			if _, perr := bus.NewProducer([]string{"127.0.0.1:1"}, bus.WithSecurity(tt.s)); perr == nil {
				t.Error("NewProducer accepted the invalid security")
			}
		})
	}
}

func TestSecurityStringMasksPassword(t *testing.T) {
	s := bus.Security{SASLMechanism: bus.SASLPlain, SASLUsername: "kvmesh", SASLPassword: "hunter2-secret"}
	var buf bytes.Buffer
	slog.New(slog.NewJSONHandler(&buf, nil)).Info("kafka", "security", s)
	for what, text := range map[string]string{"String": s.String(), "%v": fmt.Sprintf("%v", s), "%+v": fmt.Sprintf("%+v", s), "slog": buf.String()} {
		if strings.Contains(text, "hunter2") {
			t.Errorf("%s shows the password: %s", what, text)
		}
		if !strings.Contains(text, "kvmesh") {
			t.Errorf("%s lost the username: %s", what, text)
		}
	}
}

// secureBroker is an embedded broker that requires TLS or SASL, with the
// client security that it accepts.
type secureBroker struct {
	*devbroker.Broker
	certs *testenv.Certs
}

// users of every secure broker: one of each mechanism.
var secureUsers = []devbroker.SASLUser{
	{Mechanism: bus.SASLPlain, Name: "plain-user", Password: "plain-pass"},
	{Mechanism: bus.SASLScramSHA256, Name: "scram256-user", Password: "scram256-pass"},
	{Mechanism: bus.SASLScramSHA512, Name: "scram512-user", Password: "scram512-pass"},
}

// startSecureBroker starts a broker with TLS (server certificate from
// certs; clientCA also requires client certificates) and/or SASL users.
func startSecureBroker(t *testing.T, tls, clientCA, sasl bool) *secureBroker {
	t.Helper()
	certs := testenv.NewCerts(t)
	cfg := devbroker.Config{Addr: "127.0.0.1:0", Partitions: 2, Topics: []string{dlqTopic},
		GroupMinSessionTimeout: 100 * time.Millisecond}
	if tls {
		cfg.TLS = tlsfiles.Files{CertFile: certs.ServerCert, KeyFile: certs.ServerKey}
		if clientCA {
			cfg.TLS.CAFile = certs.CAFile
		}
	}
	if sasl {
		cfg.SASLUsers = secureUsers
	}
	ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
	defer cancel()
	b, err := devbroker.Start(ctx, cfg)
	if err != nil {
		t.Fatalf("devbroker.Start: %v", err)
	}
	t.Cleanup(b.Close)
	return &secureBroker{Broker: b, certs: certs}
}

// tlsClient is the TLS part of a client that trusts the broker's CA.
func (b *secureBroker) tlsClient() bus.Security {
	return bus.Security{TLS: true, CAFile: b.certs.CAFile}
}

// user returns the credentials of the secure user of mechanism m; none
// (a table bug) authenticates as nobody, which the round trip reports.
func user(m bus.SASLMechanism) (name, password string) {
	for _, u := range secureUsers {
		if u.Mechanism == m {
			return u.Name, u.Password
		}
	}
	return "", ""
}

// withSASL adds the credentials of mechanism m's user to s.
func withSASL(s bus.Security, m bus.SASLMechanism) bus.Security {
	s.SASLMechanism = string(m)
	s.SASLUsername, s.SASLPassword = user(m)
	return s
}

func TestSecureRoundTrip(t *testing.T) {
	tests := []struct {
		name                string
		tls, clientCA, sasl bool
		client              func(b *secureBroker) bus.Security
	}{
		{"tls only", true, false, false, func(b *secureBroker) bus.Security { return b.tlsClient() }},
		{"mutual tls", true, true, false, func(b *secureBroker) bus.Security {
			s := b.tlsClient()
			s.CertFile, s.KeyFile = b.certs.ClientCert, b.certs.ClientKey
			return s
		}},
		{"sasl plain", false, false, true, func(*secureBroker) bus.Security { return withSASL(bus.Security{}, bus.SASLPlain) }},
		{"sasl scram-sha-256", false, false, true, func(*secureBroker) bus.Security {
			return withSASL(bus.Security{}, bus.SASLScramSHA256)
		}},
		{"sasl scram-sha-512", false, false, true, func(*secureBroker) bus.Security {
			return withSASL(bus.Security{}, bus.SASLScramSHA512)
		}},
		{"tls and scram-sha-512", true, false, true, func(b *secureBroker) bus.Security {
			return withSASL(b.tlsClient(), bus.SASLScramSHA512)
		}},
		{"tls and plain with server name", true, false, true, func(b *secureBroker) bus.Security {
			s := withSASL(b.tlsClient(), bus.SASLPlain)
			s.ServerName = "localhost" // the certificate's DNS name, not the 127.0.0.1 dialled
			return s
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b := startSecureBroker(t, tt.tls, tt.clientCA, tt.sasl)
			sec := tt.client(b)
			if err := sec.Validate(); err != nil {
				t.Fatalf("client security invalid: %v", err)
			}
			roundTrip(t, b.Addrs(), sec)
		})
	}
}

// roundTrip creates a topic, publishes a record, consumes it with a group,
// waits for the group's commit to show in the lag, all with sec.
func roundTrip(t *testing.T, brokers []string, sec bus.Security) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
	defer cancel()
	const topic, group = "bus.test.secure", "secure-group"
	opt := bus.WithSecurity(sec)
	if err := bus.Ping(ctx, brokers, opt); err != nil {
		t.Fatalf("Ping: %v", err)
	}
	if err := bus.EnsureTopics(ctx, brokers, []string{topic}, 2, opt); err != nil {
		t.Fatalf("EnsureTopics: %v", err)
	}
	p, err := bus.NewProducer(brokers, opt, bus.WithBatchSize(1))
	if err != nil {
		t.Fatalf("NewProducer: %v", err)
	}
	defer func() {
		if err := p.Close(); err != nil {
			t.Errorf("Producer.Close: %v", err)
		}
	}()
	if err := p.Publish(ctx, bus.Message{Topic: topic, Key: "k", Value: []byte("over the secure bus")}); err != nil {
		t.Fatalf("Publish: %v", err)
	}

	got := make(chan bus.Received, 1)
	cfg := bus.ConsumerConfig{
		Brokers: brokers, Security: sec, GroupID: group, Topics: []string{topic},
		DLQTopic: dlqTopic, Producer: p, Logger: testLogger(), SyncCommit: true,
		MaxWait: 100 * time.Millisecond, SessionTimeout: 2 * time.Second, HeartbeatInterval: 100 * time.Millisecond,
		RebalanceTimeout: 2 * time.Second, JoinGroupBackoff: 100 * time.Millisecond,
	}
	c, err := bus.NewConsumer(cfg, func(_ context.Context, m bus.Received) error {
		select {
		case got <- m:
		default:
		}
		return nil
	})
	if err != nil {
		t.Fatalf("NewConsumer: %v", err)
	}
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(runCtx) }()
	defer func() {
		stop()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	}()
	select {
	case m := <-got:
		if string(m.Value) != "over the secure bus" || m.Key != "k" {
			t.Fatalf("consumed %q/%q, want k/\"over the secure bus\"", m.Key, m.Value)
		}
	case <-ctx.Done():
		t.Fatalf("no record consumed: %v", ctx.Err())
	}

	lag := bus.NewLagCollector(brokers, opt)
	defer lag.Close()
	eventually(t, "the group's lag to read 0 over the secure connection", func() bool {
		l, err := lag.Lag(ctx, group, []string{topic})
		return err == nil && l[topic] == 0
	})
}

func TestSecureRefused(t *testing.T) {
	tests := []struct {
		name                string
		tls, clientCA, sasl bool
		client              func(b *secureBroker) bus.Security
		// pingErr is a substring of Ping's error: the broker closes the
		// connection of a failed SASL exchange (EOF), TLS names its cause.
		pingErr string
	}{
		{"wrong password", false, false, true, func(*secureBroker) bus.Security {
			s := withSASL(bus.Security{}, bus.SASLScramSHA256)
			s.SASLPassword = "not-the-password"
			return s
		}, "EOF"},
		{"wrong plain password", true, false, true, func(b *secureBroker) bus.Security {
			s := withSASL(b.tlsClient(), bus.SASLPlain)
			s.SASLPassword = "not-the-password"
			return s
		}, "EOF"},
		{"user of another mechanism", false, false, true, func(*secureBroker) bus.Security {
			s := withSASL(bus.Security{}, bus.SASLScramSHA512)
			s.SASLUsername, s.SASLPassword = user(bus.SASLScramSHA256)
			return s
		}, "EOF"},
		{"no sasl against a sasl broker", false, false, true, func(*secureBroker) bus.Security { return bus.Security{} }, "EOF"},
		{"plaintext against a tls broker", true, false, false, func(*secureBroker) bus.Security { return bus.Security{} }, "EOF"},
		{"client trusting another CA", true, false, false, func(b *secureBroker) bus.Security {
			return bus.Security{TLS: true, CAFile: b.certs.OtherCAFile}
		}, "certificate signed by unknown authority"},
		{"wrong server name", true, false, false, func(b *secureBroker) bus.Security {
			s := b.tlsClient()
			s.ServerName = "kafka.example"
			return s
		}, "not kafka.example"},
		{"no client certificate for mutual tls", true, true, false, func(b *secureBroker) bus.Security { return b.tlsClient() }, "certificate required"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b := startSecureBroker(t, tt.tls, tt.clientCA, tt.sasl)
			refused(t, b.Addrs(), tt.client(b), tt.pingErr)
		})
	}
}

// refused checks that every client made with sec fails, each within
// refuseLimit.
func refused(t *testing.T, brokers []string, sec bus.Security, pingErr string) {
	t.Helper()
	opt := bus.WithSecurity(sec)
	bounded := func(what string, call func(ctx context.Context) error) {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), refuseLimit)
		defer cancel()
		start := time.Now()
		err := call(ctx)
		if err == nil {
			t.Errorf("%s succeeded, want it refused", what)
			return
		}
		if elapsed := time.Since(start); elapsed > refuseLimit+time.Second {
			t.Errorf("%s took %v to fail: %v", what, elapsed, err)
		}
	}
	bounded("Ping", func(ctx context.Context) error {
		err := bus.Ping(ctx, brokers, opt)
		if err != nil && !strings.Contains(err.Error(), pingErr) {
			t.Errorf("Ping: %v, want an error containing %q", err, pingErr)
		}
		return err
	})
	bounded("EnsureTopics", func(ctx context.Context) error {
		return bus.EnsureTopics(ctx, brokers, []string{"bus.test.refused"}, 1, opt)
	})
	bounded("Publish", func(ctx context.Context) error {
		p, err := bus.NewProducer(brokers, opt, bus.WithBatchSize(1))
		if err != nil {
			t.Fatalf("NewProducer: %v", err)
		}
		defer p.Close()
		return p.Publish(ctx, bus.Message{Topic: dlqTopic, Value: []byte("x")})
	})
	bounded("Lag", func(ctx context.Context) error {
		lag := bus.NewLagCollector(brokers, opt)
		defer lag.Close()
		_, err := lag.Lag(ctx, "refused-group", []string{dlqTopic})
		return err
	})
	consumerRefused(t, brokers, sec)
}

// consumerRefused checks that a consumer made with sec reports reader
// errors and delivers nothing; its Run stops when its context ends.
func consumerRefused(t *testing.T, brokers []string, sec bus.Security) {
	t.Helper()
	logs := &testenv.SyncBuffer{}
	handled := make(chan struct{}, 1)
	c, err := bus.NewConsumer(bus.ConsumerConfig{
		Brokers: brokers, Security: sec, GroupID: "refused-group", Topics: []string{"bus.test.refused.in"},
		OnDeadLetter: func(context.Context, bus.Received, kvcore.Reason, error) error { return nil },
		Logger:       slog.New(slog.NewTextHandler(logs, nil)),
		MaxWait:      100 * time.Millisecond, SessionTimeout: 2 * time.Second, HeartbeatInterval: 100 * time.Millisecond,
		RebalanceTimeout: 2 * time.Second, JoinGroupBackoff: 100 * time.Millisecond,
	}, func(context.Context, bus.Received) error { handled <- struct{}{}; return nil })
	if err != nil {
		t.Fatalf("NewConsumer: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), refuseLimit)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	eventually(t, "the refused consumer to log a reader error", func() bool {
		return strings.Contains(logs.String(), "kafka reader error")
	})
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Logf("Run: %v", err)
		}
	case <-time.After(waitLimit):
		t.Fatal("Run did not return after its context ended")
	}
	select {
	case <-handled:
		t.Error("the refused consumer handled a record")
	default:
	}
}

func TestSecurityPasswordFromFile(t *testing.T) {
	// A secret given as NAME_FILE (a mounted secret) reaches the client:
	// the SCRAM handshake only succeeds with the file's password.
	b := startSecureBroker(t, false, false, true)
	name, pass := user(bus.SASLScramSHA256)
	file := filepath.Join(t.TempDir(), "password")
	if err := os.WriteFile(file, []byte(pass+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	env := map[string]string{
		"KVMESH_KAFKA_SASL_MECHANISM":     "SCRAM-SHA-256",
		"KVMESH_KAFKA_SASL_USERNAME":      name,
		"KVMESH_KAFKA_SASL_PASSWORD_FILE": file,
	}
	sec, err := bus.LoadSecurity(func(k string) (string, bool) { v, ok := env[k]; return v, ok })
	if err != nil {
		t.Fatalf("LoadSecurity: %v", err)
	}
	if sec.SASLPassword != pass {
		t.Fatalf("password from file not loaded")
	}
	ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
	defer cancel()
	if err := bus.Ping(ctx, b.Addrs(), bus.WithSecurity(sec)); err != nil {
		t.Fatalf("Ping: %v", err)
	}
}
