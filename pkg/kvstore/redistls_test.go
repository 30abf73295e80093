package kvstore_test

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/internal/kvstoretest"
	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
	"github.com/kvmesh/kvmesh/pkg/tlsfiles"
)

// refusedWithin bounds how long a refused connection may take to fail:
// every refusal below must be reported, not retried until the caller's
// deadline.
const refusedWithin = 8 * time.Second

// TestRedisTLSContract runs the Store contract against a redis-server that
// speaks TLS only, verified with the test CA, as an ACL user (the default
// user is off): go-redis's commands and the store's own EXISTS and GET
// connections all go over TLS and authenticate.
func TestRedisTLSContract(t *testing.T) {
	certs := testenv.NewCerts(t)
	srv := testenv.StartTLSRedis(t, certs, testenv.TLSRedisOptions{})
	opts := kvstore.RedisOptions{TLS: kvstore.RedisTLS{CAFile: certs.CAFile}}
	kvstoretest.RunContractTests(t, func(t *testing.T) kvstore.Store {
		return newRedis(t, srv.URL(), opts)
	})
}

// TestRedisTLSOwnConnections checks that Exists and GetEach, which a
// single-server store answers over connections of its own (not
// go-redis's), work over TLS as an ACL user, on the URL's database: they
// find what Put stored, and go over those connections.
func TestRedisTLSOwnConnections(t *testing.T) {
	certs := testenv.NewCerts(t)
	for _, tc := range []struct {
		name string
		opts testenv.TLSRedisOptions
		tls  kvstore.RedisTLS
	}{
		{"server TLS", testenv.TLSRedisOptions{}, kvstore.RedisTLS{CAFile: certs.CAFile}},
		{"mutual TLS", testenv.TLSRedisOptions{ClientCerts: true},
			kvstore.RedisTLS{CAFile: certs.CAFile, CertFile: certs.ClientCert, KeyFile: certs.ClientKey}},
		{"server name", testenv.TLSRedisOptions{}, kvstore.RedisTLS{CAFile: certs.CAFile, ServerName: "localhost"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := testenv.StartTLSRedis(t, certs, tc.opts)
			url := strings.TrimSuffix(srv.URL(), "/0") + "/2"
			r := newRedis(t, url, kvstore.RedisOptions{TLS: tc.tls})
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			keys := testKeys(t, r, 40) // more than one EXISTS run of 16
			values := map[int][]byte{0: []byte("first"), 17: bytes.Repeat([]byte("x"), 70_000), 39: {}}
			var items []kvstore.Item
			for i, v := range values {
				items = append(items, kvstore.Item{Key: keys[i], Value: v})
			}
			if err := putAll(r, items...); err != nil {
				t.Fatal(err)
			}
			kvstore.ExistsPipelines(r) // reset the count
			found, err := r.Exists(ctx, keys)
			if err != nil {
				t.Fatalf("Exists: %v", err)
			}
			for i, f := range found {
				if _, want := values[i]; f != want {
					t.Errorf("Exists[%d] = %v, want %v", i, f, want)
				}
			}
			if n, ok := kvstore.ExistsPipelines(r); !ok || n == 0 {
				t.Errorf("Exists did not go over the store's own connections (%d, %v)", n, ok)
			}
			got := map[int][]byte{}
			errs, err := r.GetEach(ctx, keys, func(i int, v []byte) error {
				got[i] = bytes.Clone(v)
				return nil
			})
			if err != nil {
				t.Fatalf("GetEach: %v", err)
			}
			for i := range keys {
				want, present := values[i]
				switch {
				case present && (errs[i] != nil || !bytes.Equal(got[i], want)):
					t.Errorf("GetEach[%d] = %d bytes, %v; want %d bytes", i, len(got[i]), errs[i], len(want))
				case !present && !errors.Is(errs[i], kvstore.ErrNotFound):
					t.Errorf("GetEach[%d] error = %v, want ErrNotFound", i, errs[i])
				}
			}
			if n, ok := kvstore.ExistsPipelines(r); !ok || n == 0 {
				t.Errorf("GetEach did not go over the store's own connections (%d, %v)", n, ok)
			}
			// Database 2, not 0: the connections selected the URL's database.
			db0 := newRedis(t, srv.URL(), kvstore.RedisOptions{TLS: tc.tls})
			if found, err := db0.Exists(ctx, keys[:1]); err != nil || found[0] {
				t.Errorf("Exists on database 0 = %v, %v; want [false]", found, err)
			}
		})
	}
}

// TestRedisTLSRefusals checks that each misconfiguration of TLS or of the
// ACL credentials fails NewRedis promptly, with an error that says why and
// never shows the password.
func TestRedisTLSRefusals(t *testing.T) {
	certs := testenv.NewCerts(t)
	srv := testenv.StartTLSRedis(t, certs, testenv.TLSRedisOptions{})
	mtls := testenv.StartTLSRedis(t, certs, testenv.TLSRedisOptions{ClientCerts: true})
	trusted := kvstore.RedisTLS{CAFile: certs.CAFile}
	tests := []struct {
		name string
		url  string
		tls  kvstore.RedisTLS
		want string // in the error's text
		is   error  // when not nil, the error wraps it
	}{
		{"wrong ACL password", srv.URLAs(srv.User, "not-"+srv.Password), trusted, "WRONGPASS", nil},
		{"unknown ACL user", srv.URLAs("nobody", srv.Password), trusted, "WRONGPASS", nil},
		{"no credentials (default user off)", "rediss://" + srv.Addr() + "/0", trusted, "NOAUTH", nil},
		{"client trusts another CA", srv.URL(), kvstore.RedisTLS{CAFile: certs.OtherCAFile},
			"certificate signed by unknown authority", kvstore.ErrUnavailable},
		{"client trusts the system roots", srv.URL(), kvstore.RedisTLS{},
			"certificate signed by unknown authority", kvstore.ErrUnavailable},
		{"server name not in the certificate", srv.URL(), kvstore.RedisTLS{CAFile: certs.CAFile, ServerName: "redis.example"},
			"not redis.example", kvstore.ErrUnavailable},
		{"plain redis:// against the TLS port", "redis://" + srv.User + ":" + srv.Password + "@" + srv.Addr() + "/0", kvstore.RedisTLS{},
			"if it speaks TLS, use rediss://", kvstore.ErrUnavailable},
		{"TLS settings with a plain URL", "redis://" + srv.User + ":" + srv.Password + "@" + srv.Addr() + "/0", trusted,
			"use rediss://", nil},
		{"mutual TLS without a client certificate", mtls.URL(), trusted, "store unavailable", kvstore.ErrUnavailable},
		{"certificate without its key", mtls.URL(), kvstore.RedisTLS{CAFile: certs.CAFile, CertFile: certs.ClientCert},
			"needs its key", tlsfiles.ErrIncomplete},
		{"missing CA file", srv.URL(), kvstore.RedisTLS{CAFile: certs.Dir + "/absent.pem"}, "CA file", nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithTimeout(context.Background(), 2*refusedWithin)
			defer cancel()
			start := time.Now()
			r, err := kvstore.NewRedis(ctx, tt.url, kvstore.RedisOptions{TLS: tt.tls, DialTimeout: 2 * time.Second})
			took := time.Since(start)
			if err == nil {
				_ = r.Close()
				t.Fatal("NewRedis succeeded")
			}
			t.Logf("error after %v: %v", took.Round(time.Millisecond), err)
			if took > refusedWithin {
				t.Errorf("NewRedis took %v to fail, want under %v", took, refusedWithin)
			}
			if !strings.Contains(err.Error(), tt.want) {
				t.Errorf("error %q does not say %q", err, tt.want)
			}
			if tt.is != nil && !errors.Is(err, tt.is) {
				t.Errorf("error %v does not wrap %v", err, tt.is)
			}
			if strings.Contains(err.Error(), srv.Password) || strings.Contains(err.Error(), mtls.Password) {
				t.Errorf("error %q shows the password", err)
			}
		})
	}
}

// TestRedisTLSOptions checks how RedisTLS reaches go-redis's options of a
// single server and of a cluster, without a server.
func TestRedisTLSOptions(t *testing.T) {
	certs := testenv.NewCerts(t)
	ca := kvstore.RedisTLS{CAFile: certs.CAFile}
	tests := []struct {
		name       string
		url        string
		tls        kvstore.RedisTLS
		wantTLS    bool
		serverName string
		skipVerify bool
		wantErr    string
	}{
		{"plain, no settings", "redis://h:6379/0", kvstore.RedisTLS{}, false, "", false, ""},
		{"rediss, system roots", "rediss://h:6379/0", kvstore.RedisTLS{}, true, "h", false, ""},
		{"rediss, test CA", "rediss://u:p@h:6379/1", ca, true, "h", false, ""},
		{"rediss, server name", "rediss://h:6379/0", kvstore.RedisTLS{CAFile: certs.CAFile, ServerName: "redis.internal"}, true, "redis.internal", false, ""},
		{"rediss, skip_verify kept", "rediss://h:6379/0?skip_verify=true", ca, true, "h", true, ""},
		{"rediss, client certificate", "rediss://h:6379/0", kvstore.RedisTLS{CertFile: certs.ClientCert, KeyFile: certs.ClientKey}, true, "h", false, ""},
		{"plain with a CA", "redis://h:6379/0", ca, false, "", false, "use rediss://"},
		{"plain with a server name", "redis://h:6379/0", kvstore.RedisTLS{ServerName: "x"}, false, "", false, "use rediss://"},
		{"key without certificate", "rediss://h:6379/0", kvstore.RedisTLS{KeyFile: certs.ClientKey}, false, "", false, "needs its key"},
		{"CA file without certificates", "rediss://h:6379/0", kvstore.RedisTLS{CAFile: certs.ClientKey}, false, "", false, "no PEM certificate"},
		{"cluster, test CA", "rediss+cluster://a:1,b:2", ca, true, "a", false, ""},
		{"cluster, server name", "rediss+cluster://a:1,b:2", kvstore.RedisTLS{CAFile: certs.CAFile, ServerName: "nodes.internal"}, true, "nodes.internal", false, ""},
		{"plain cluster with a CA", "redis+cluster://a:1,b:2", ca, false, "", false, "use rediss://"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			opts := kvstore.RedisOptions{TLS: tt.tls}
			var (
				cfgOK   bool
				name    string
				skip    bool
				hasCA   bool
				hasCert bool
				err     error
			)
			if kvstore.IsClusterURL(tt.url) {
				co, e := kvstore.RedisClusterOptions(tt.url, opts)
				if err = e; e == nil && co.TLSConfig != nil {
					cfgOK, name, skip = true, co.TLSConfig.ServerName, co.TLSConfig.InsecureSkipVerify
					hasCA, hasCert = co.TLSConfig.RootCAs != nil, len(co.TLSConfig.Certificates) > 0
				}
			} else {
				ro, e := kvstore.RedisClientOptions(tt.url, opts)
				if err = e; e == nil && ro.TLSConfig != nil {
					cfgOK, name, skip = true, ro.TLSConfig.ServerName, ro.TLSConfig.InsecureSkipVerify
					hasCA, hasCert = ro.TLSConfig.RootCAs != nil, len(ro.TLSConfig.Certificates) > 0
				}
			}
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("error = %v, want one saying %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if cfgOK != tt.wantTLS || name != tt.serverName || skip != tt.skipVerify {
				t.Errorf("TLS = %v, server name %q, skip_verify %v; want %v, %q, %v", cfgOK, name, skip, tt.wantTLS, tt.serverName, tt.skipVerify)
			}
			if hasCA != (tt.tls.CAFile != "") {
				t.Errorf("root CAs set = %v, want %v", hasCA, tt.tls.CAFile != "")
			}
			if hasCert != (tt.tls.CertFile != "") {
				t.Errorf("client certificate set = %v, want %v", hasCert, tt.tls.CertFile != "")
			}
		})
	}
}

// TestRedisURLErrorsHidePassword checks that a URL that does not parse is
// reported without its password (net/url's errors quote the whole URL).
func TestRedisURLErrorsHidePassword(t *testing.T) {
	for _, u := range []string{
		"rediss://kvmesh:hunter2secret@127.0.0.1:notaport/0",
		"rediss+cluster://kvmesh:hunter2secret@a:1,b:2/0?%zz",
		"rediss://kvmesh:hunter2secret@h:6379/0\x7f",
		"rediss://kvmesh:hunter2secret@h:6379/0?addr=b:1&addr=%zz:2",
	} {
		_, err := kvstore.NewRedis(context.Background(), u, kvstore.RedisOptions{})
		if err == nil || errors.Is(err, kvstore.ErrUnavailable) {
			t.Errorf("NewRedis(%q) = %v, want a parse error", u, err)
			continue
		}
		if strings.Contains(err.Error(), "hunter2secret") {
			t.Errorf("NewRedis error shows the password: %v", err)
		}
	}
}

// TestRedisTLSClusterContract runs the Store contract against a Redis
// Cluster that speaks TLS only, named by a rediss+cluster:// URL with an
// ACL user and verified with the test CA: every node's client, including
// those go-redis opens after MOVED replies, uses RedisOptions.TLS.
func TestRedisTLSClusterContract(t *testing.T) {
	certs := testenv.NewCerts(t)
	c := testenv.StartTLSRedisCluster(t, certs)
	opts := kvstore.RedisOptions{TLS: kvstore.RedisTLS{CAFile: certs.CAFile}}
	kvstoretest.RunContractTests(t, func(t *testing.T) kvstore.Store {
		return newRedis(t, c.URL(), opts)
	})
	t.Run("another CA", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), 2*refusedWithin)
		defer cancel()
		start := time.Now()
		r, err := kvstore.NewRedis(ctx, c.URL(), kvstore.RedisOptions{TLS: kvstore.RedisTLS{CAFile: certs.OtherCAFile}, DialTimeout: 2 * time.Second})
		if err == nil {
			_ = r.Close()
			t.Fatal("NewRedis succeeded")
		}
		if took := time.Since(start); took > refusedWithin || !strings.Contains(err.Error(), "certificate signed by unknown authority") ||
			strings.Contains(err.Error(), c.Password) {
			t.Errorf("after %v: %v; want the unknown authority, promptly, without the password", took, err)
		}
	})
}
