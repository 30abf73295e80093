// Package adminapi holds the JSON shapes of the services' admin REST APIs:
// the request trackers and failed outbox rows of the scheduler, the dead
// letters, replays, stats and worker registry of the sender, and the pool of
// a gpuworker. The services encode these types and the operator CLI
// (cmd/kvmesh) decodes them, so each shape is written once; the services'
// OpenAPI documents (services/*/internal/app/openapi.yaml) describe them.
package adminapi

// Page is one page of a paginated list route.
type Page[T any] struct {
	// Items are the page's entries, in the route's order.
	Items []T `json:"items"`
	// NextCursor fetches the next page; absent on the last one.
	NextCursor string `json:"next_cursor,omitempty"`
}
