package service

import (
	"net/http"

	"github.com/kvmesh/kvmesh/pkg/adminapi"
	"github.com/kvmesh/kvmesh/pkg/httpserver"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// ModelsRoute is the route of the served models.
const ModelsRoute = "/v1/models"

// ModelsHandler answers GET /v1/models: every model of r, the default
// first, with its fingerprint and layout (adminapi.ServedModels).
func ModelsHandler(r *kvcore.Models) http.HandlerFunc {
	answer := adminapi.DescribeModels(r)
	return func(w http.ResponseWriter, _ *http.Request) {
		_ = httpserver.WriteJSON(w, http.StatusOK, answer) // a failed write is the client's loss
	}
}
