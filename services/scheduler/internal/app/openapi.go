package app

import (
	_ "embed" // the OpenAPI document

	"github.com/kvmesh/kvmesh/pkg/httpserver"
)

// OpenAPI is the scheduler's OpenAPI 3.1 document, served at GET /openapi.yaml.
// A test checks that it documents exactly the routes the service serves.
//
//go:embed openapi.yaml
var OpenAPI []byte

// Routes lists the routes the service serves, from its router.
func (a *App) Routes() []httpserver.Route { return a.srv.Routes() }
