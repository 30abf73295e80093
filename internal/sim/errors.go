package sim

import "errors"

// Sentinel errors of the simulator.
var (
	// ErrWorkload reports a workload that cannot be generated.
	ErrWorkload = errors.New("invalid workload")
	// ErrConfig reports a simulator configuration that cannot run.
	ErrConfig = errors.New("invalid simulator config")
	// ErrLookupUnavailable reports a lookup answered 503 or not at all: the
	// engine retries it on a later step.
	ErrLookupUnavailable = errors.New("lookup unavailable")
	// ErrLookupRejected reports a lookup refused as invalid (4xx).
	ErrLookupRejected = errors.New("lookup rejected")
	// ErrHTTP reports an admin API answer the simulator cannot use.
	ErrHTTP = errors.New("unexpected HTTP answer")
	// errProtocol reports a gpuworker answer that does not fit the
	// request (a bug, not an outage: not retried).
	errProtocol = errors.New("gpuworker answer does not fit the request")
	// errNotFound reports an admin API's 404: no such resource.
	errNotFound = errors.New("not found")
	// errNoTopic reports a topic the brokers do not have.
	errNoTopic = errors.New("topic not found")
)
