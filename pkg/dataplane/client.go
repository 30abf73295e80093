package dataplane

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"

	"go.opentelemetry.io/contrib/instrumentation/net/http/otelhttp"
)

// DefaultWriteBatchBytes is how many bytes (frames included) one Write
// request carries before the client starts another.
const DefaultWriteBatchBytes = 64 << 20

// Client talks to one gpuworker's data plane over HTTP. It is safe for
// concurrent use.
type Client struct {
	base string
	hc   *http.Client
	// WriteBatchBytes splits a Write into requests of at most this many
	// bytes, frame headers included (at least one block each); zero means
	// DefaultWriteBatchBytes.
	WriteBatchBytes int
}

// NewClient returns a client for the worker at baseURL (e.g.
// "http://10.0.0.5:8084"). A nil hc gets a client whose transport propagates
// trace context and keeps connections to the worker open.
func NewClient(baseURL string, hc *http.Client) *Client {
	if hc == nil {
		hc = DefaultHTTPClient()
	}
	return &Client{base: strings.TrimRight(baseURL, "/"), hc: hc}
}

// DefaultHTTPClient returns an HTTP client suited to the data plane: W3C
// trace context on every request and enough idle connections per worker for
// concurrent batches.
func DefaultHTTPClient() *http.Client {
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.MaxIdleConnsPerHost = 32
	tr.WriteBufferSize = 256 << 10
	tr.ReadBufferSize = 256 << 10
	return &http.Client{Transport: otelhttp.NewTransport(tr)}
}

// Put reads the listed pool blocks, frames each value (model fingerprint +
// checksum + bytes) and stores them in the store pool in one batch; results
// are per item, in order, and bytes counts the framed bytes stored. err is a
// whole-request failure (worker unreachable, 5xx, or a rejected request):
// the caller treats ErrUnavailable as transient.
func (c *Client) Put(ctx context.Context, items []PutItem) ([]PutResult, int64, error) {
	if len(items) == 0 {
		return []PutResult{}, 0, nil
	}
	body, err := json.Marshal(PutRequest{Items: items})
	if err != nil {
		return nil, 0, fmt.Errorf("dataplane put: %w", err)
	}
	resp, err := c.post(ctx, PathPut, "application/json", bytes.NewReader(body), int64(len(body)))
	if err != nil {
		return nil, 0, fmt.Errorf("dataplane put: %w", err)
	}
	defer drain(resp.Body)
	var out PutResponse
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil {
		return nil, 0, fmt.Errorf("dataplane put: answer: %w: %w", ErrUnavailable, err)
	}
	if len(out.Results) != len(items) {
		return nil, 0, fmt.Errorf("dataplane put: %d results for %d items: %w", len(out.Results), len(items), ErrFrame)
	}
	return out.Results, out.Bytes, nil
}

// Write puts bytes into pool blocks (the engine's compute; used by the
// simulator and tests). Each block's Data must be exactly its group's
// bytes_per_block. Large writes are split into several requests; a failure
// may leave earlier blocks written.
func (c *Client) Write(ctx context.Context, blocks []Block) error {
	limit := c.WriteBatchBytes
	if limit <= 0 {
		limit = DefaultWriteBatchBytes
	}
	for start := 0; start < len(blocks); {
		end, size := start, 0
		for end < len(blocks) && (end == start || size+FrameHeaderSize+len(blocks[end].Data) <= limit) {
			size += FrameHeaderSize + len(blocks[end].Data)
			end++
		}
		if err := c.writeBatch(ctx, blocks[start:end]); err != nil {
			return fmt.Errorf("dataplane write: %w", err)
		}
		start = end
	}
	return nil
}

func (c *Client) writeBatch(ctx context.Context, blocks []Block) error {
	bufs := make(net.Buffers, 0, 2*len(blocks))
	headers := make([]byte, 0, FrameHeaderSize*len(blocks))
	var n int64
	for _, b := range blocks {
		at := len(headers)
		headers = AppendFrameHeader(headers, FrameHeader{
			Group: b.Group, Block: b.Block, Len: len(b.Data), Checksum: Checksum(b.Data),
		})
		bufs = append(bufs, headers[at:len(headers):len(headers)], b.Data)
		n += int64(FrameHeaderSize + len(b.Data))
	}
	resp, err := c.post(ctx, PathWrite, ContentTypeFrames, &bufs, n)
	if err != nil {
		return err
	}
	drain(resp.Body)
	return nil
}

// Read returns pool blocks' bytes, in the order asked (tests, pd loads from a
// remote engine's worker, verification). Every block's checksum is verified;
// a mismatch is an ErrChecksum error.
func (c *Client) Read(ctx context.Context, refs []BlockRef) ([]Block, error) {
	if len(refs) == 0 {
		return []Block{}, nil
	}
	body, err := json.Marshal(ReadRequest{Blocks: refs})
	if err != nil {
		return nil, fmt.Errorf("dataplane read: %w", err)
	}
	resp, err := c.post(ctx, PathRead, "application/json", bytes.NewReader(body), int64(len(body)))
	if err != nil {
		return nil, fmt.Errorf("dataplane read: %w", err)
	}
	defer drain(resp.Body)
	out, err := readFrames(resp.Body, refs)
	if err != nil {
		return nil, fmt.Errorf("dataplane read: %w", err)
	}
	return out, nil
}

// readFrames reads one frame per ref, in order, then expects the end.
func readFrames(r io.Reader, refs []BlockRef) ([]Block, error) {
	out := make([]Block, len(refs))
	for i, ref := range refs {
		h, err := ReadFrameHeader(r)
		if errors.Is(err, io.EOF) {
			return nil, fmt.Errorf("stream ended after %d of %d blocks: %w", i, len(refs), ErrFrame)
		}
		if err != nil {
			return nil, err
		}
		if h.Ref() != ref {
			return nil, fmt.Errorf("frame %d is %+v, asked %+v: %w", i, h.Ref(), ref, ErrFrame)
		}
		data := make([]byte, h.Len)
		if err := ReadFrameData(r, h, data); err != nil {
			return nil, err
		}
		out[i] = Block{BlockRef: ref, Data: data}
	}
	var one [1]byte
	if n, _ := io.ReadFull(r, one[:]); n > 0 {
		return nil, fmt.Errorf("data after the last frame: %w", ErrFrame)
	}
	return out, nil
}

// post sends one request and maps a non-2xx answer to ErrRejected (4xx) or
// ErrUnavailable (transport failure, 5xx).
func (c *Client) post(ctx context.Context, path, contentType string, body io.Reader, n int64) (*http.Response, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.base+path, body)
	if err != nil {
		return nil, err
	}
	req.ContentLength = n
	req.Header.Set("Content-Type", contentType)
	resp, err := c.hc.Do(req)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrUnavailable, err)
	}
	if resp.StatusCode/100 == 2 {
		return resp, nil
	}
	defer drain(resp.Body)
	detail := problemDetail(resp.Body)
	if resp.StatusCode/100 == 4 {
		return nil, fmt.Errorf("%s: %d %s: %w", path, resp.StatusCode, detail, ErrRejected)
	}
	return nil, fmt.Errorf("%s: %d %s: %w", path, resp.StatusCode, detail, ErrUnavailable)
}

// problemDetail extracts the detail (or title) of a problem+json body.
func problemDetail(r io.Reader) string {
	var p struct {
		Title  string `json:"title"`
		Detail string `json:"detail"`
	}
	if err := json.NewDecoder(io.LimitReader(r, 64<<10)).Decode(&p); err != nil {
		return "(no problem detail)"
	}
	if p.Detail != "" {
		return p.Detail
	}
	return p.Title
}

// drain reads a little of what is left and closes the body so the
// connection can be reused.
func drain(rc io.ReadCloser) {
	_, _ = io.Copy(io.Discard, io.LimitReader(rc, 256<<10))
	_ = rc.Close()
}
