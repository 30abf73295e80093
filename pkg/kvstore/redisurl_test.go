package kvstore_test

import (
	"slices"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/pkg/kvstore"
)

func TestIsClusterURL(t *testing.T) {
	tests := []struct {
		url  string
		want bool
	}{
		{"redis+cluster://127.0.0.1:7000,127.0.0.1:7001", true},
		{"rediss+cluster://a:7000", true},
		{"REDIS+CLUSTER://a:7000", true},
		{"redis://a:7000?addr=b:7001", true},
		{"rediss://a:7000/0?addr=b:7001&addr=c:7002", true},
		{"redis://a:6379/0", false},
		{"rediss://user:pw@a:6379", false},
		{"redis://a:6379?dial_timeout=1s", false},
		{"unix:///tmp/redis.sock", false},
		{"a:6379", false},
		{"", false},
	}
	for _, tc := range tests {
		if got := kvstore.IsClusterURL(tc.url); got != tc.want {
			t.Errorf("IsClusterURL(%q) = %v, want %v", tc.url, got, tc.want)
		}
	}
}

func TestRedisClusterOptions(t *testing.T) {
	tests := []struct {
		name      string
		url       string
		addrs     []string
		user, pw  string
		tls       bool
		redirects int
		wantErr   bool
	}{
		{name: "seeds", url: "redis+cluster://127.0.0.1:7000,127.0.0.1:7001,127.0.0.1:7002",
			addrs: []string{"127.0.0.1:7000", "127.0.0.1:7001", "127.0.0.1:7002"}},
		{name: "trailing slash and db 0", url: "redis+cluster://a:1,b:2/0", addrs: []string{"a:1", "b:2"}},
		{name: "default port", url: "redis+cluster://a,b:7001", addrs: []string{"a:6379", "b:7001"}},
		{name: "ipv6", url: "redis+cluster://[::1]:7000,[::1]", addrs: []string{"[::1]:7000", "[::1]:6379"}},
		{name: "userinfo", url: "redis+cluster://u:p%40ss@a:1,b:2/", addrs: []string{"a:1", "b:2"}, user: "u", pw: "p@ss"},
		{name: "tls", url: "rediss+cluster://a:1,b:2", addrs: []string{"a:1", "b:2"}, tls: true},
		{name: "options", url: "redis+cluster://a:1,b:2/?max_redirects=7", addrs: []string{"a:1", "b:2"}, redirects: 7},
		{name: "go-redis form", url: "redis://u:p@a:1?addr=b:2&addr=c:3", addrs: []string{"a:1", "b:2", "c:3"}, user: "u", pw: "p"},
		{name: "no hosts", url: "redis+cluster:///", wantErr: true},
		{name: "only commas", url: "redis+cluster://,,", wantErr: true},
		{name: "bad port", url: "redis+cluster://a:1,b:port", wantErr: true},
		{name: "port out of range", url: "redis+cluster://a:70000", wantErr: true},
		{name: "empty host", url: "redis+cluster://:7000", wantErr: true},
		{name: "db 1", url: "redis+cluster://a:1,b:2/1", wantErr: true},
		{name: "db 1 in go-redis form", url: "redis://a:1/1?addr=b:2", wantErr: true},
		{name: "unknown option", url: "redis+cluster://a:1?bogus=1", wantErr: true},
		{name: "single server", url: "redis://a:6379/0", wantErr: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			co, err := kvstore.RedisClusterOptions(tc.url, kvstore.RedisOptions{})
			if tc.wantErr {
				if err == nil {
					t.Fatalf("RedisClusterOptions(%q) = %+v, want an error", tc.url, co.Addrs)
				}
				return
			}
			if err != nil {
				t.Fatalf("RedisClusterOptions(%q): %v", tc.url, err)
			}
			if !slices.Equal(co.Addrs, tc.addrs) {
				t.Errorf("Addrs = %q, want %q", co.Addrs, tc.addrs)
			}
			if co.Username != tc.user || co.Password != tc.pw {
				t.Errorf("credentials = %q/%q, want %q/%q", co.Username, co.Password, tc.user, tc.pw)
			}
			if (co.TLSConfig != nil) != tc.tls {
				t.Errorf("TLS = %v, want %v", co.TLSConfig != nil, tc.tls)
			}
			if co.MaxRedirects != tc.redirects {
				t.Errorf("MaxRedirects = %d, want %d", co.MaxRedirects, tc.redirects)
			}
			if !co.ContextTimeoutEnabled {
				t.Error("ContextTimeoutEnabled is off; callers' deadlines would not bound socket I/O")
			}
		})
	}
}

func TestRedisClusterOptionsApplyConnSettings(t *testing.T) {
	o := kvstore.RedisOptions{PoolSize: 3, DialTimeout: time.Second, ReadTimeout: 2 * time.Second,
		WriteTimeout: 3 * time.Second, MaxRetries: -1, DialAttempts: 2}
	co, err := kvstore.RedisClusterOptions("redis+cluster://a:1,b:2?pool_size=50&read_timeout=9s", o)
	if err != nil {
		t.Fatal(err)
	}
	if co.PoolSize != 3 || co.DialTimeout != time.Second || co.ReadTimeout != 2*time.Second ||
		co.WriteTimeout != 3*time.Second || co.MaxRetries != -1 || co.DialerRetries != 2 {
		t.Errorf("options not applied: %+v", co)
	}
}

func TestRedisClientOptionsRejectsClusterURL(t *testing.T) {
	if _, err := kvstore.RedisClientOptions("redis+cluster://a:1,b:2", kvstore.RedisOptions{}); err == nil {
		t.Error("RedisClientOptions accepted a cluster URL")
	}
	ro, err := kvstore.RedisClientOptions("redis://a:6379/2", kvstore.RedisOptions{PoolSize: 4})
	if err != nil || ro.Addr != "a:6379" || ro.DB != 2 || ro.PoolSize != 4 {
		t.Errorf("RedisClientOptions(single server) = %+v, %v", ro, err)
	}
}

// A single server's pipeline write buffer is small by default (a large
// value is then copied into it only a few KiB deep), unless the URL sets it.
func TestRedisClientOptionsPipelineWriteBuffer(t *testing.T) {
	ro, err := kvstore.RedisClientOptions("redis://127.0.0.1:6379/0", kvstore.RedisOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if got := ro.PipelineWriteBufferSize; got != 16<<10 {
		t.Errorf("default pipeline write buffer %d, want %d", got, 16<<10)
	}
	ro, err = kvstore.RedisClientOptions("redis://127.0.0.1:6379/0?pipeline_write_buffer_size=65536", kvstore.RedisOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if got := ro.PipelineWriteBufferSize; got != 65536 {
		t.Errorf("the URL's pipeline write buffer: got %d, want 65536", got)
	}
}
