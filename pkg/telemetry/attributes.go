package telemetry

// Span attribute keys every service and the simulator use for a request:
// the trace checks (deploy's, e2e's) and the Grafana request panel find a
// request's spans by AttrRequestID.
const (
	// AttrRequestID is the engine's request id.
	AttrRequestID = "kvmesh.request_id"
	// AttrEngineID is the engine id.
	AttrEngineID = "kvmesh.engine_id"
)
