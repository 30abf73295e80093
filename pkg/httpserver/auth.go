package httpserver

import (
	"crypto/sha256"
	"crypto/subtle"
	"net/http"
	"strings"
)

// AdminTokenEnv names the variable that holds the admin token, for messages.
const AdminTokenEnv = "KVMESH_ADMIN_TOKEN"

// RequireAdmin returns middleware that admits only requests carrying
// "Authorization: Bearer <token>". A missing or non-bearer header, or a
// wrong token, gets 401 with a WWW-Authenticate challenge. When token is empty
// the server has no admin token and every request is refused with 403 (fail
// closed). Tokens are compared in constant time.
func RequireAdmin(token string) func(http.Handler) http.Handler {
	want := sha256.Sum256([]byte(token))
	return func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if token == "" {
				WriteProblem(w, r, http.StatusForbidden, "",
					"admin routes are disabled: "+AdminTokenEnv+" is not set on this service", nil)
				return
			}
			got, ok := bearerToken(r.Header.Get("Authorization"))
			if !ok {
				w.Header().Set("WWW-Authenticate", `Bearer realm="kvmesh"`)
				WriteProblem(w, r, http.StatusUnauthorized, "",
					"this route needs an Authorization: Bearer <admin token> header", nil)
				return
			}
			sum := sha256.Sum256([]byte(got))
			if subtle.ConstantTimeCompare(sum[:], want[:]) != 1 {
				w.Header().Set("WWW-Authenticate", `Bearer realm="kvmesh", error="invalid_token"`)
				WriteProblem(w, r, http.StatusUnauthorized, "", "the admin token is not valid", nil)
				return
			}
			next.ServeHTTP(w, r)
		})
	}
}

// bearerToken extracts the token of a Bearer Authorization header; the
// scheme is case-insensitive.
func bearerToken(header string) (string, bool) {
	scheme, token, ok := strings.Cut(strings.TrimSpace(header), " ")
	if !ok || !strings.EqualFold(scheme, "Bearer") {
		return "", false
	}
	token = strings.TrimSpace(token)
	return token, token != ""
}
