package app

import (
	"net/http"

	"github.com/kvmesh/kvmesh/pkg/dataplane"
)

// peerClient is the HTTP client of this worker's reads from other
// gpuworkers (pd loads): the data plane's transport with the service's
// HTTPS client settings and, when authentication is required, a service
// token of its own.
func (a *App) peerClient() (*http.Client, error) {
	rt, err := a.cfg.ServiceTransport("gpuworker", dataplane.DefaultTransport())
	if err != nil {
		return nil, err
	}
	return dataplane.HTTPClient(rt), nil
}
