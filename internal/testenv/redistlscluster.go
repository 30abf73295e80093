package testenv

import (
	"context"
	"net"
	"net/url"
	"os/exec"
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"
)

// tlsClusterMasters is how many masters a TLSCluster has (no replicas).
const tlsClusterMasters = 3

// TLSCluster is a Redis Cluster of three masters on loopback, without
// replicas, that speaks TLS only, its cluster bus included, with the
// certificates of Certs, the default user off and one ACL user,
// TLSRedisUser, allowed everything. StartTLSRedisCluster starts it.
type TLSCluster struct {
	// Certs are the nodes' certificate and the CA that signed it.
	Certs *Certs
	// User and Password are the ACL user's credentials.
	User, Password string
	nodes          []*serverProcess
}

// StartTLSRedisCluster starts three redis-servers in cluster mode with
// TLS on their client port and their cluster bus (tls-cluster yes; each
// node presents the test client certificate to the others), no plain
// port, joins them with `redis-cli --tls --cluster create` as the ACL
// user, waits until every node reports cluster_state:ok, and kills them
// when the test ends. Without redis-server or redis-cli on PATH the test
// is skipped, or fails when KVMESH_REQUIRE_SERVICES=1.
func StartTLSRedisCluster(t testing.TB, certs *Certs) *TLSCluster {
	t.Helper()
	bins := clusterBinaries(t)
	c := &TLSCluster{Certs: certs, User: TLSRedisUser, Password: randomHex(t, 16)}
	probe := &TLSRedisServer{Certs: certs}
	clientCfg, err := probe.clientConfig(false)
	if err != nil {
		t.Fatalf("redis cluster (tls): client configuration: %v", err)
	}
	for range tlsClusterMasters {
		dir := t.TempDir()
		launch := func(int) (*serverProcess, error) {
			port, err := freePort()
			if err != nil {
				return nil, err
			}
			bus, err := freePort()
			if err != nil {
				return nil, err
			}
			args := []string{
				"--port", "0", "--tls-port", port, "--cluster-port", bus, "--bind", "127.0.0.1",
				"--save", "", "--appendonly", "no", "--dir", dir,
				"--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
				"--cluster-node-timeout", clusterNodeTimeout,
				"--tls-cluster", "yes", "--tls-replication", "yes",
				"--tls-cert-file", certs.ServerCert, "--tls-key-file", certs.ServerKey,
				"--tls-client-cert-file", certs.ClientCert, "--tls-client-key-file", certs.ClientKey,
				"--tls-ca-cert-file", certs.CAFile, "--tls-auth-clients", "no",
				"--user", "default", "off",
				"--user", c.User, "on", ">" + c.Password, "~*", "&*", "+@all",
			}
			return launchServer("redis-server (tls cluster node)", bins.server, net.JoinHostPort("127.0.0.1", port), args)
		}
		c.nodes = append(c.nodes, startServer(t, launch, func(s *serverProcess) error {
			return tlsPing(s.addr, clientCfg, c.User, c.Password)
		}))
	}
	t.Cleanup(func() {
		if t.Failed() {
			for _, n := range c.nodes {
				t.Logf("--- %s %s ---\n%s", n.name, n.addr, tail(n.Output(), clusterLogLines))
			}
		}
	})
	args := append([]string{"--tls", "--cacert", certs.CAFile, "--user", c.User, "--pass", c.Password,
		"--no-auth-warning", "--cluster", "create"}, c.Addrs()...)
	args = append(args, "--cluster-replicas", "0", "--cluster-yes")
	if out, err := exec.Command(bins.cli, args...).CombinedOutput(); err != nil {
		t.Fatalf("redis-cli --tls --cluster create: %v\n%s", err, strings.ReplaceAll(string(out), c.Password, "***"))
	}
	err = pollCluster(clusterReadyWithin, func(ctx context.Context) error {
		for _, addr := range c.Addrs() {
			n := redis.NewClient(&redis.Options{
				Addr: addr, Username: c.User, Password: c.Password, TLSConfig: clientCfg.Clone(),
				MaxRetries: -1, DialTimeout: clusterCommandTimeout, ReadTimeout: clusterCommandTimeout,
			})
			err := clusterStateOK(ctx, n)
			_ = n.Close() // closing a client of a test's own node
			if err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatalf("redis cluster (tls) not ready: %v", err)
	}
	return c
}

// Addrs returns the nodes' addresses.
func (c *TLSCluster) Addrs() []string {
	addrs := make([]string, len(c.nodes))
	for i, n := range c.nodes {
		addrs[i] = n.addr
	}
	return addrs
}

// URL returns the cluster's rediss+cluster:// URL with the ACL user's
// credentials and every node as a seed.
func (c *TLSCluster) URL() string {
	return "rediss+cluster://" + url.UserPassword(c.User, c.Password).String() + "@" + strings.Join(c.Addrs(), ",")
}

// tail returns the last n lines of s.
func tail(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
