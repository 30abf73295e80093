package app_test

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/httpserver"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
)

// TestLookupBinaryOverRedisTLS runs the lookup binary against a store pool
// that speaks TLS only, requires a client certificate and has the default
// user off, configured as an operator would: KVMESH_REDIS_URL=rediss://
// with an ACL user and password, and KVMESH_REDIS_CA_FILE,
// KVMESH_REDIS_CERT_FILE and KVMESH_REDIS_KEY_FILE. It becomes ready with
// the store healthy, answers a lookup from keys seeded over TLS (the
// store's own EXISTS connections, TLS and AUTH included), and its log
// never shows the password. Without the CA setting it refuses to start,
// saying why, again without the password.
func TestLookupBinaryOverRedisTLS(t *testing.T) {
	certs := testenv.NewCerts(t)
	rs := testenv.StartTLSRedis(t, certs, testenv.TLSRedisOptions{ClientCerts: true})
	env, _ := brokerEnv(t, rs.URL())
	bin := testenv.ServiceBinaries(t, "lookup")["lookup"]
	spec := writeSpec(t, specDense)
	model, err := loadModel(spec)
	if err != nil {
		t.Fatal(err)
	}
	prefix := randomID("tlstest-")
	base := []string{
		"KVMESH_AUTH=off", "KVMESH_KAFKA_BROKERS=" + strings.Join(env.Brokers, ","), "KVMESH_KAFKA_PARTITIONS=2",
		"KVMESH_REDIS_URL=" + rs.URL(), "KVMESH_KEY_PREFIX=" + prefix, "KVMESH_MODEL=" + spec,
		"KVMESH_LOG_LEVEL=debug", "KVMESH_SHUTDOWN_TIMEOUT=2s",
		"KVMESH_REDIS_CERT_FILE=" + certs.ClientCert, "KVMESH_REDIS_KEY_FILE=" + certs.ClientKey,
	}
	ps := testenv.NewProcs(t)
	logOf := func(p *testenv.Process) string { return p.LogTail(100000) }

	t.Run("with the CA", func(t *testing.T) {
		p, err := ps.Add("lookup", bin, append(base, "KVMESH_REDIS_CA_FILE="+certs.CAFile)...)
		if err != nil {
			t.Fatal(err)
		}
		if err := p.Start(); err != nil {
			t.Fatal(err)
		}
		s := &lookupService{addr: p.Addr(), prefix: prefix, model: model}
		if r := s.readyz(t); r.status != http.StatusOK || len(r.Degraded) != 0 || r.Checks["store"].Status != httpserver.StatusOK {
			t.Fatalf("/readyz %+v, want 200 with the store ok", r)
		}
		files := kvstore.RedisTLS{CAFile: certs.CAFile, CertFile: certs.ClientCert, KeyFile: certs.ClientKey}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		st, err := kvstore.NewRedis(ctx, rs.URL(), kvstore.RedisOptions{TLS: files})
		if err != nil {
			t.Fatal(err)
		}
		defer st.Close()
		toks := tokens(48, 907)
		keys := groupKeys(s.keys(), 0, kvcore.HashChain(toks, 16, nil), 0, 1)
		items := []kvstore.Item{{Key: keys[0], Value: []byte("kv")}, {Key: keys[1], Value: []byte("kv")}}
		if errs, err := st.Put(ctx, items); err != nil || errs[0] != nil || errs[1] != nil {
			t.Fatalf("seed: %v %v", errs, err)
		}
		if d := s.lookup(t, body("tls", toks, 0)); d.ExternalTokens != 32 {
			t.Errorf("lookup over the TLS store: %d external tokens, want 32", d.ExternalTokens)
		}
		if log := logOf(p); strings.Contains(log, rs.Password) {
			t.Errorf("the lookup's log shows the store password:\n%s", log)
		}
	})

	t.Run("without the CA", func(t *testing.T) {
		p, err := ps.Add("lookup-no-ca", bin, base...)
		if err != nil {
			t.Fatal(err)
		}
		err = p.Start()
		if err == nil {
			t.Fatal("the lookup started although it cannot verify the store's certificate")
		}
		if !errors.Is(err, testenv.ErrExited) {
			t.Fatalf("start: %v, want the process to exit", err)
		}
		log := logOf(p)
		if !strings.Contains(log, "certificate signed by unknown authority") {
			t.Errorf("the lookup's log does not say why it stopped:\n%s", log)
		}
		if strings.Contains(log, rs.Password) {
			t.Errorf("the lookup's log shows the store password:\n%s", log)
		}
	})
}
