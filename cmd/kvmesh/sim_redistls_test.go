package main

import (
	"testing"

	"github.com/kvmesh/kvmesh/pkg/kvstore"
)

// TestSimFlagsRedisTLS: the store check's TLS settings come from the
// services' variables (KVMESH_REDIS_CA_FILE, ...), which the -redis-*
// flags override.
func TestSimFlagsRedisTLS(t *testing.T) {
	quiet(t)
	t.Setenv("KVMESH_REDIS_CA_FILE", "/env/ca.pem")
	t.Setenv("KVMESH_REDIS_CERT_FILE", "/env/client.pem")
	t.Setenv("KVMESH_REDIS_KEY_FILE", "/env/client-key.pem")
	t.Setenv("KVMESH_REDIS_SERVER_NAME", "")
	for _, tc := range []struct {
		args []string
		want kvstore.RedisTLS
	}{
		{nil, kvstore.RedisTLS{CAFile: "/env/ca.pem", CertFile: "/env/client.pem", KeyFile: "/env/client-key.pem"}},
		{[]string{"-redis-ca-file", "/flag/ca.pem", "-redis-server-name", "redis.internal", "-redis-cert-file", "", "-redis-key-file", ""},
			kvstore.RedisTLS{CAFile: "/flag/ca.pem", ServerName: "redis.internal"}},
	} {
		o, err := simFlags(tc.args)
		if err != nil {
			t.Fatalf("%q: %v", tc.args, err)
		}
		if o.cfg.RedisTLS != tc.want {
			t.Errorf("%q: RedisTLS %+v, want %+v", tc.args, o.cfg.RedisTLS, tc.want)
		}
	}
}
