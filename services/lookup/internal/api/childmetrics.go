package api

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvmesh/kvmesh/pkg/kvstore"
	"github.com/kvmesh/kvmesh/services/lookup/internal/connector"
)

// childFailureReasons are the reasons whose series exist from the start
// for every store child (so that rate() sees the first failure): the
// kvstore statuses of a store that went away or stopped answering.
var childFailureReasons = []string{kvstore.StatusUnavailable, kvstore.StatusTimeout}

// newChildFailures registers kvmesh_lookup_child_failures_total{child,reason}:
// connector-chain children whose check failed and that answered 0 (fail
// open), as vLLM's store child records a failed lookup_exists operation
// and answers 0 (MooncakeStoreWorker.lookup).
func newChildFailures(reg prometheus.Registerer, children []string) (*prometheus.CounterVec, error) {
	c := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvmesh_lookup_child_failures_total",
		Help: "Connector-chain children whose check failed during a lookup and that answered 0 tokens (fail open), by child and reason (a kvstore status: unavailable, timeout, closed, canceled, error).",
	}, []string{"child", "reason"})
	if err := reg.Register(c); err != nil {
		return nil, fmt.Errorf("lookup metrics: %w", err)
	}
	for _, child := range children {
		if child != connector.NameStore {
			continue
		}
		for _, r := range childFailureReasons {
			c.WithLabelValues(child, r)
		}
	}
	return c, nil
}
