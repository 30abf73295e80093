package httpserver

import (
	"net/http"
	"strconv"
)

// PathOpenAPI is the route on which a service serves its OpenAPI document.
const PathOpenAPI = "/openapi.yaml"

// ContentTypeYAML is the media type of the OpenAPI document.
const ContentTypeYAML = "application/yaml"

// ServeOpenAPI mounts GET /openapi.yaml, answering doc (the service's
// OpenAPI 3.1 document, usually embedded with go:embed) as it is, and
// reads the access rules the server enforces from the document's
// security requirements (AccessRules). A document whose rules cannot be
// read makes Run fail, and every route but the built-in ones is refused.
func (s *Server) ServeOpenAPI(doc []byte) {
	s.access.rules, s.access.err = AccessRules(doc)
	s.mux.Get(PathOpenAPI, func(w http.ResponseWriter, _ *http.Request) {
		h := w.Header()
		h.Set("Content-Type", ContentTypeYAML)
		h.Set("X-Content-Type-Options", "nosniff")
		h.Set("Content-Length", strconv.Itoa(len(doc)))
		w.WriteHeader(http.StatusOK)
		_, _ = w.Write(doc) // a failed write means the client left
	})
}
