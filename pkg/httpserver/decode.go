package httpserver

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"reflect"
	"strings"
)

// Errors returned by DecodeJSON, wrapped with the detail sent to the client.
var (
	// ErrInvalidJSON means the body is not one JSON value that fits the
	// destination.
	ErrInvalidJSON = errors.New("invalid JSON body")
	// ErrBodyTooLarge means the body exceeds the server's size limit.
	ErrBodyTooLarge = errors.New("request body too large")
	// ErrUnsupportedMediaType means the Content-Type is not JSON.
	ErrUnsupportedMediaType = errors.New("unsupported media type")
)

// DecodeJSON decodes the request body into dst strictly: the body must be
// exactly one JSON value, unknown object fields are rejected, and a
// Content-Type other than JSON (application/json or any +json type) is
// refused. On failure it writes the problem response itself (400, 413 or
// 415, with a detail naming the bad field or type) and returns an error
// wrapping ErrInvalidJSON, ErrBodyTooLarge or ErrUnsupportedMediaType; the
// handler then just returns. A request that did not pass through the
// server's middleware is limited to DefaultMaxBodyBytes.
func DecodeJSON(w http.ResponseWriter, r *http.Request, dst any) error {
	if err := checkJSONType(r.Header.Get("Content-Type")); err != nil {
		WriteProblem(w, r, http.StatusUnsupportedMediaType, "", err.Error(), nil)
		return err
	}
	body := r.Body
	if _, limited := r.Context().Value(bodyKey).(io.ReadCloser); !limited {
		body = http.MaxBytesReader(w, body, DefaultMaxBodyBytes)
	}
	dec := json.NewDecoder(body)
	dec.DisallowUnknownFields()
	err := dec.Decode(dst)
	if err == nil {
		err = expectEOF(dec)
	}
	if err == nil {
		return nil
	}
	status, detail, extras := describeDecodeError(err)
	WriteProblem(w, r, status, "", detail, extras)
	if status == http.StatusRequestEntityTooLarge {
		return fmt.Errorf("%w: %s", ErrBodyTooLarge, detail)
	}
	return fmt.Errorf("%w: %s", ErrInvalidJSON, detail)
}

// errTrailingData means the body held more than one JSON value.
var errTrailingData = errors.New("body must contain a single JSON value")

// expectEOF checks that nothing but white space follows the first value.
func expectEOF(dec *json.Decoder) error {
	var extra json.RawMessage
	err := dec.Decode(&extra)
	if errors.Is(err, io.EOF) {
		return nil
	}
	var tooLarge *http.MaxBytesError
	if errors.As(err, &tooLarge) {
		return err
	}
	return errTrailingData
}

// checkJSONType accepts an absent Content-Type, application/json and any
// +json media type.
func checkJSONType(ct string) error {
	if ct == "" {
		return nil
	}
	mt, _, err := mime.ParseMediaType(ct)
	if err == nil && (mt == ContentTypeJSON || strings.HasSuffix(mt, "+json")) {
		return nil
	}
	return fmt.Errorf("%w: Content-Type %q, want %s", ErrUnsupportedMediaType, ct, ContentTypeJSON)
}

// describeDecodeError maps a decoding error to a status, a client-facing
// detail and extension members.
func describeDecodeError(err error) (int, string, map[string]any) {
	var (
		tooLarge  *http.MaxBytesError
		syntaxErr *json.SyntaxError
		typeErr   *json.UnmarshalTypeError
	)
	switch {
	case errors.As(err, &tooLarge):
		return http.StatusRequestEntityTooLarge,
			fmt.Sprintf("request body exceeds %d bytes", tooLarge.Limit), nil
	case errors.Is(err, io.EOF):
		return http.StatusBadRequest, "request body is empty", nil
	case errors.Is(err, io.ErrUnexpectedEOF):
		return http.StatusBadRequest, "malformed JSON: the body ends in the middle of a value", nil
	case errors.As(err, &syntaxErr):
		return http.StatusBadRequest,
			fmt.Sprintf("malformed JSON at byte offset %d: %s", syntaxErr.Offset, syntaxErr.Error()), nil
	case errors.As(err, &typeErr):
		return describeTypeError(typeErr)
	case errors.Is(err, errTrailingData):
		return http.StatusBadRequest, err.Error(), nil
	}
	if field, ok := strings.CutPrefix(err.Error(), "json: unknown field "); ok {
		name := strings.Trim(field, `"`)
		return http.StatusBadRequest, fmt.Sprintf("unknown field %q", name), map[string]any{"field": name}
	}
	return http.StatusBadRequest, "invalid JSON body: " + err.Error(), nil
}

// describeTypeError names the field and the expected and received JSON types.
func describeTypeError(e *json.UnmarshalTypeError) (int, string, map[string]any) {
	want := jsonTypeName(e.Type)
	if e.Field == "" {
		return http.StatusBadRequest, fmt.Sprintf("body must be a JSON %s, got %s", want, e.Value), nil
	}
	return http.StatusBadRequest,
		fmt.Sprintf("field %q must be a JSON %s, got %s", e.Field, want, e.Value),
		map[string]any{"field": e.Field}
}

// jsonTypeName names the JSON form of a Go type.
func jsonTypeName(t reflect.Type) string {
	if t == nil {
		return "value"
	}
	switch t.Kind() {
	case reflect.String:
		return "string"
	case reflect.Bool:
		return "boolean"
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return "integer"
	case reflect.Float32, reflect.Float64:
		return "number"
	case reflect.Slice, reflect.Array:
		return "array"
	case reflect.Map, reflect.Struct:
		return "object"
	case reflect.Pointer:
		return jsonTypeName(t.Elem())
	}
	return t.String()
}
