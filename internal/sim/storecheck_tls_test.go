package sim

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
)

// TestCheckStoredOverTLS: the run's check of stored values reads them
// back from a store pool that speaks TLS only, with an ACL user, when
// Config.RedisTLS names the CA that signed its certificate; without it the
// check reports the unknown authority, not the password.
func TestCheckStoredOverTLS(t *testing.T) {
	certs := testenv.NewCerts(t)
	srv := testenv.StartTLSRedis(t, certs, testenv.TLSRedisOptions{})
	m := preset(t, "hybrid-mla-linear")
	kb := kvcore.KeysOf(m).WithPrefix("tlsdep")
	hashes := kvcore.HashChain(make([]uint32, 32), 16, []byte("tls"))
	keys := []string{kb.Key(kvcore.Rank{}, 0, hashes[0]), kb.Key(kvcore.Rank{}, 0, hashes[1])}
	files := kvstore.RedisTLS{CAFile: certs.CAFile}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	st, err := kvstore.NewRedis(ctx, srv.URL(), kvstore.RedisOptions{TLS: files})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	value := dataplane.EncodeValue(m.Fingerprint(), BlockContent(m, 0, kvcore.Rank{}, hashes[0]))
	if errs, err := st.Put(ctx, []kvstore.Item{{Key: keys[0], Value: value}}); err != nil || errs[0] != nil {
		t.Fatalf("put: %v %v", errs, err)
	}
	never := func(string) bool { return false }

	cfg := Config{RedisURL: srv.URL(), RedisTLS: files, Model: m, RequestTimeout: time.Second}
	if c := checkStored(ctx, cfg, keys, never); !c.OK || c.Checked != 1 || c.Gone != 1 || c.Error != "" {
		t.Errorf("check over TLS: %+v, want OK with 1 checked and 1 gone", c)
	}
	cfg.RedisTLS = kvstore.RedisTLS{}
	c := checkStored(ctx, cfg, keys, never)
	if c.OK || !strings.Contains(c.Error, "certificate signed by unknown authority") || strings.Contains(c.Error, srv.Password) {
		t.Errorf("check without the CA: %+v, want an unknown-authority error without the password", c)
	}
}
