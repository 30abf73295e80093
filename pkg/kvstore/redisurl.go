package kvstore

import (
	"fmt"
	"net"
	"net/url"
	"strconv"
	"strings"

	"github.com/redis/go-redis/v9"
)

// URL schemes that name a Redis Cluster by its seed nodes.
const (
	// clusterScheme is a Redis Cluster over plain TCP.
	clusterScheme = "redis+cluster"
	// clusterTLSScheme is a Redis Cluster over TLS.
	clusterTLSScheme = "rediss+cluster"
	// defaultRedisPort is the port of a seed node named without one.
	defaultRedisPort = "6379"
)

// IsClusterURL reports whether rawURL names a Redis Cluster rather than a
// single server: the scheme redis+cluster:// or rediss+cluster://, or
// go-redis's cluster form, redis:// or rediss:// with addr= query
// parameters naming further seed nodes. It does not validate the rest.
func IsClusterURL(rawURL string) bool {
	scheme, rest, ok := strings.Cut(rawURL, "://")
	if !ok {
		return false
	}
	switch strings.ToLower(scheme) {
	case clusterScheme, clusterTLSScheme:
		return true
	case "redis", "rediss":
		_, query, _ := strings.Cut(rest, "?")
		q, err := url.ParseQuery(query)
		return err == nil && q.Has("addr")
	default:
		return false
	}
}

// RedisClusterOptions are the go-redis cluster options of the store pool
// at the cluster URL rawURL (see IsClusterURL) with opts' connection settings, for
// NewRedis and for a client of the same cluster beside the Store (the
// sender's watcher of keyspace notifications). The URL is
//
//	redis+cluster://[user:pass@]host1:port1,host2:port2,...[/[0]][?options]
//
// (rediss+cluster:// for TLS), or go-redis's form
// redis://[user:pass@]host1:port1[/0]?addr=host2:port2&addr=...; the
// options are go-redis's cluster URL options (max_redirects,
// read_timeout, pool_size, ...), which opts' non-zero fields override. A
// rediss+cluster:// URL's TLS configuration, shared by every node's client,
// is built from opts.TLS.
func RedisClusterOptions(rawURL string, opts RedisOptions) (*redis.ClusterOptions, error) {
	if !IsClusterURL(rawURL) {
		return nil, fmt.Errorf("kvstore: redis cluster url: %w", errNotCluster)
	}
	co, err := parseClusterURL(rawURL)
	if err != nil {
		return nil, fmt.Errorf("kvstore: redis cluster url: %w", urlError(err))
	}
	if co.TLSConfig, err = opts.TLS.config(co.TLSConfig); err != nil {
		return nil, fmt.Errorf("kvstore: redis cluster tls: %w", err)
	}
	opts.applyCluster(co)
	return co, nil
}

// parseClusterURL turns a cluster URL into go-redis's cluster options:
// redis+cluster:// URLs are rewritten into go-redis's addr= form, which
// redis.ParseClusterURL then parses with all of its options. The host list
// is split by hand because net/url accepts one host per URL.
func parseClusterURL(raw string) (*redis.ClusterOptions, error) {
	scheme, rest, _ := strings.Cut(raw, "://")
	scheme = strings.ToLower(scheme)
	if scheme == "redis" || scheme == "rediss" {
		u, err := url.Parse(raw)
		if err != nil {
			return nil, err
		}
		if err := checkClusterDB(u.Path); err != nil {
			return nil, err
		}
		return redis.ParseClusterURL(raw)
	}
	authority, tail := rest, ""
	if i := strings.IndexAny(rest, "/?#"); i >= 0 {
		authority, tail = rest[:i], rest[i:]
	}
	userinfo, hosts := "", authority
	if i := strings.LastIndexByte(authority, '@'); i >= 0 {
		userinfo, hosts = authority[:i+1], authority[i+1:]
	}
	seeds, err := splitSeeds(hosts)
	if err != nil {
		return nil, err
	}
	path, query, _ := strings.Cut(tail, "?")
	query, _, _ = strings.Cut(query, "#")
	if err := checkClusterDB(path); err != nil {
		return nil, err
	}
	q, err := url.ParseQuery(query)
	if err != nil {
		return nil, fmt.Errorf("query: %w", err)
	}
	for _, s := range seeds[1:] {
		q.Add("addr", s)
	}
	plain := strings.TrimSuffix(scheme, "+cluster")
	rewritten := plain + "://" + userinfo + seeds[0] + "/?" + q.Encode()
	return redis.ParseClusterURL(rewritten)
}

// splitSeeds validates a comma-separated list of host[:port] and returns
// each as host:port.
func splitSeeds(hosts string) ([]string, error) {
	var seeds []string
	for part := range strings.SplitSeq(hosts, ",") {
		if part = strings.TrimSpace(part); part == "" {
			continue
		}
		seed, err := normalizeSeed(part)
		if err != nil {
			return nil, err
		}
		seeds = append(seeds, seed)
	}
	if len(seeds) == 0 {
		return nil, errNoSeeds
	}
	return seeds, nil
}

// normalizeSeed checks one seed node, host, host:port, [v6] or [v6]:port,
// and returns it as host:port.
func normalizeSeed(s string) (string, error) {
	host, port, err := net.SplitHostPort(s)
	if err != nil {
		// No port: a bare host name or address, or a bracketed IPv6 one.
		host, port = strings.TrimSuffix(strings.TrimPrefix(s, "["), "]"), defaultRedisPort
		if strings.Contains(host, ":") && !strings.HasPrefix(s, "[") {
			return "", fmt.Errorf("%w: %q", errBadSeed, s)
		}
	}
	n, err := strconv.Atoi(port)
	if host == "" || err != nil || n < 1 || n > 65535 {
		return "", fmt.Errorf("%w: %q", errBadSeed, s)
	}
	return net.JoinHostPort(host, port), nil
}

// checkClusterDB accepts the URL paths that mean database 0: none, "/" and "/0".
func checkClusterDB(path string) error {
	switch strings.TrimSuffix(path, "/") {
	case "", "/0":
		return nil
	default:
		return fmt.Errorf("%w: path %q", errClusterDB, path)
	}
}
