package api

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"strings"

	"github.com/kvmesh/kvmesh/pkg/httpserver"
)

// ContentTypeBinary is the media type of the binary lookup body: the JSON
// request on one line (the head: every field of the JSON form except the
// hash chain, with block_hash_bytes and num_tokens), one '\n', then the raw
// hashes concatenated, each block_hash_bytes long. It is the form a fast
// engine sends: nothing of the chain is parsed, only its length checked.
const ContentTypeBinary = "application/vnd.kvmesh.lookup"

// FieldBinaryHashes names the hashes part of a binary body in problems.
const FieldBinaryHashes = "(binary hashes)"

// isBinary reports whether the Content-Type is ContentTypeBinary.
func isBinary(ct string) bool {
	if !strings.HasPrefix(strings.ToLower(ct), ContentTypeBinary) {
		return false // a JSON lookup: no parameters to parse
	}
	mt, _, err := mime.ParseMediaType(ct)
	return err == nil && mt == ContentTypeBinary
}

// decodeBinary reads a binary body into req: its head through
// httpserver.DecodeJSON (same strictness, same problems), its hashes kept
// as they came, in the one buffer the body was read into. On failure it
// has written the problem.
func decodeBinary(w http.ResponseWriter, r *http.Request, req *Request, limit int64) error {
	body, err := readBody(r, limit)
	if err != nil {
		var tooLarge *http.MaxBytesError
		if errors.As(err, &tooLarge) {
			httpserver.WriteProblem(w, r, http.StatusRequestEntityTooLarge, "", fmt.Sprintf("request body exceeds %d bytes", tooLarge.Limit), nil)
			return fmt.Errorf("%w: %w", httpserver.ErrBodyTooLarge, err)
		}
		httpserver.WriteProblem(w, r, http.StatusBadRequest, "", "the request body could not be read", nil)
		return fmt.Errorf("read binary body: %w", err)
	}
	i := bytes.IndexByte(body, '\n')
	if i < 0 {
		httpserver.WriteProblem(w, r, http.StatusBadRequest, "", ErrNoHead.Error(), nil)
		return ErrNoHead
	}
	head := r.WithContext(r.Context())
	head.Header = r.Header.Clone()
	head.Header.Set("Content-Type", httpserver.ContentTypeJSON)
	head.Body = io.NopCloser(bytes.NewReader(body[:i]))
	if err := httpserver.DecodeJSON(w, head, req); err != nil {
		return err
	}
	req.binary, req.rawHashes = true, body[i+1:]
	return nil
}

// readBody reads the whole body, in one allocation when the client sent
// a length within limit; the body limit itself is the one BodyLimit set.
func readBody(r *http.Request, limit int64) ([]byte, error) {
	var buf bytes.Buffer
	if r.ContentLength > 0 && r.ContentLength <= limit {
		buf.Grow(int(r.ContentLength) + bytes.MinRead)
	}
	if _, err := buf.ReadFrom(r.Body); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}
