// Package adminapi holds the JSON shapes of the services' admin REST APIs:
// the request trackers and failed outbox rows of the scheduler, the dead
// letters, replays, stats and worker registry of the sender, and the pool of
// a gpuworker, and the served models of the lookup, the scheduler and the
// sender. The services encode these types and the operator CLI
// (cmd/kvmesh) decodes them, so each shape is written once; the services'
// OpenAPI documents (services/*/internal/app/openapi.yaml) describe them.
package adminapi

import "github.com/kvmesh/kvmesh/pkg/kvcore"

// Page is one page of a paginated list route.
type Page[T any] struct {
	// Items are the page's entries, in the route's order.
	Items []T `json:"items"`
	// NextCursor fetches the next page; absent on the last one.
	NextCursor string `json:"next_cursor,omitempty"`
}

// ServedModel is one model a mesh serves, in GET /v1/models of the
// lookup, the scheduler and the sender.
type ServedModel struct {
	// Name is the name engines send (vLLM's served model name).
	Name string `json:"name"`
	// Default is set for the services' KVMESH_MODEL.
	Default bool `json:"default"`
	// Fingerprint is the compatibility fingerprint in every key of the
	// model (kvcore.Model.Fingerprint).
	Fingerprint string `json:"fingerprint"`
	// WorkerRanks is how many gpuworkers one engine of the model runs.
	WorkerRanks int `json:"worker_ranks"`
	// Spec is the model's layout as the services loaded it.
	Spec *kvcore.Model `json:"spec"`
}

// ServedModels is the answer of GET /v1/models: every served model, the
// default first.
type ServedModels struct {
	Items []ServedModel `json:"items"`
}

// DescribeModels lists the models of r as GET /v1/models answers them.
func DescribeModels(r *kvcore.Models) ServedModels {
	out := ServedModels{Items: make([]ServedModel, 0, len(r.All()))}
	for i, m := range r.All() {
		out.Items = append(out.Items, ServedModel{Name: m.Name, Default: i == 0, Fingerprint: m.Fingerprint(),
			WorkerRanks: len(m.WorkerRanks()), Spec: m})
	}
	return out
}
