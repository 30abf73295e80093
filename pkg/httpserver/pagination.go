package httpserver

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
)

// Page sizes of every paginated list route: the limit query parameter
// defaults to DefaultPageLimit and may be 1 to MaxPageLimit.
const (
	DefaultPageLimit = 100
	MaxPageLimit     = 1000
)

// Query parameters of paginated list routes.
const (
	ParamLimit  = "limit"
	ParamCursor = "cursor"
)

// ErrBadCursor reports a cursor that this API did not make.
var ErrBadCursor = errors.New("not a cursor this API returned")

// BadParameter answers 400 with a problem whose parameter member names
// the bad query or path parameter.
func BadParameter(w http.ResponseWriter, r *http.Request, name, detail string) {
	WriteProblem(w, r, http.StatusBadRequest, "", detail, map[string]any{"parameter": name})
}

// PageLimit reads the limit query parameter: DefaultPageLimit when it is
// absent, else an integer from 1 to MaxPageLimit. A bad value is answered
// with a 400 naming the parameter, and ok is false.
func PageLimit(w http.ResponseWriter, r *http.Request) (limit int, ok bool) {
	v := r.URL.Query().Get(ParamLimit)
	if v == "" {
		return DefaultPageLimit, true
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 1 || n > MaxPageLimit {
		BadParameter(w, r, ParamLimit, fmt.Sprintf("limit %q must be an integer from 1 to %d", v, MaxPageLimit))
		return 0, false
	}
	return n, true
}

// PageCursor reads the cursor query parameter into dst (see
// EncodeCursor). present is false when there is none; a cursor this API
// did not make is answered with a 400 naming the parameter, and ok is
// false.
func PageCursor(w http.ResponseWriter, r *http.Request, dst any) (present, ok bool) {
	v := r.URL.Query().Get(ParamCursor)
	if v == "" {
		return false, true
	}
	if err := DecodeCursor(v, dst); err != nil {
		BadParameter(w, r, ParamCursor, fmt.Sprintf("cursor %q is %s", v, ErrBadCursor))
		return true, false
	}
	return true, true
}

// EncodeCursor makes an opaque cursor from v: its JSON, base64url-encoded
// without padding. v must encode (a struct of strings and numbers does).
func EncodeCursor(v any) string {
	b, err := json.Marshal(v)
	if err != nil {
		return ""
	}
	return base64.RawURLEncoding.EncodeToString(b)
}

// DecodeCursor reads a cursor made by EncodeCursor into dst, strictly:
// unknown fields are refused. Errors wrap ErrBadCursor.
func DecodeCursor(s string, dst any) error {
	b, err := base64.RawURLEncoding.DecodeString(s)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrBadCursor, err)
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(dst); err != nil {
		return fmt.Errorf("%w: %w", ErrBadCursor, err)
	}
	if dec.More() {
		return fmt.Errorf("%w: trailing data", ErrBadCursor)
	}
	return nil
}
