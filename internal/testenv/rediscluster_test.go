package testenv

import (
	"fmt"
	"slices"
	"strings"
	"testing"
)

func TestNewRedisClusterFailover(t *testing.T) {
	var nodes []string
	t.Run("cluster", func(t *testing.T) {
		c := NewRedisCluster(t)
		url := c.URL()
		nodes = strings.Split(strings.TrimPrefix(url, "redis+cluster://"), ",")
		if !strings.HasPrefix(url, "redis+cluster://") || len(nodes) != 2*clusterMasters {
			t.Fatalf("URL() = %q, want redis+cluster:// and %d nodes", url, 2*clusterMasters)
		}
		masters := c.Masters()
		if len(masters) != clusterMasters {
			t.Fatalf("Masters() = %v, want %d", masters, clusterMasters)
		}
		owners := map[string]bool{}
		for i := range 100 {
			m := c.MasterOf(t, fmt.Sprintf("key-%d", i))
			if !slices.Contains(masters, m) {
				t.Fatalf("MasterOf(key-%d) = %s, not one of %v", i, m, masters)
			}
			owners[m] = true
		}
		if len(owners) != clusterMasters {
			t.Errorf("100 keys live on %d masters, want all %d", len(owners), clusterMasters)
		}
		killed := masters[0]
		c.KillMaster(t, killed)
		c.WaitFailover(t, killed)
		after := c.Masters()
		if len(after) != clusterMasters || slices.Contains(after, killed) {
			t.Errorf("Masters() after failover = %v, want %d without %s", after, clusterMasters, killed)
		}
	})
	for _, addr := range nodes {
		if err := ping(addr); err == nil {
			t.Errorf("node %s still answers after its test ended", addr)
		}
	}
}

func TestRedisClusterShared(t *testing.T) {
	a, b := RedisCluster(t), RedisCluster(t)
	if a != b || a.URL() != b.URL() {
		t.Errorf("RedisCluster returned two clusters: %s and %s", a.URL(), b.URL())
	}
	if m := a.Masters(); len(m) != clusterMasters {
		t.Errorf("Masters() = %v, want %d", m, clusterMasters)
	}
}
