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
	return HTTPClient(DefaultTransport())
}

// DefaultTransport is the transport of DefaultHTTPClient before trace
// propagation: enough idle connections per worker for concurrent batches
// and large socket buffers. Services add TLS and credentials to it.
func DefaultTransport() *http.Transport {
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.MaxIdleConnsPerHost = 32
	tr.WriteBufferSize = 256 << 10
	tr.ReadBufferSize = 256 << 10
	return tr
}

// HTTPClient is a data-plane client over rt that propagates W3C trace
// context on every request.
func HTTPClient(rt http.RoundTripper) *http.Client {
	return &http.Client{Transport: otelhttp.NewTransport(rt)}
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
// bytes_per_block and its Identity must name what the bytes are: the
// worker records it, and every later read checks it. Large writes are split
// into several requests; a failure may leave earlier blocks written.
func (c *Client) Write(ctx context.Context, blocks []Block) error {
	limit := c.WriteBatchBytes
	if limit <= 0 {
		limit = DefaultWriteBatchBytes
	}
	for i, b := range blocks {
		if err := b.Identity.Validate(); err != nil {
			return fmt.Errorf("dataplane write: block %d (group %d block %d): %w", i, b.Group, b.Block, err)
		}
	}
	for start := 0; start < len(blocks); {
		end, size := start, 0
		for end < len(blocks) && (end == start || size+frameSize(blocks[end]) <= limit) {
			size += frameSize(blocks[end])
			end++
		}
		if err := c.writeBatch(ctx, blocks[start:end]); err != nil {
			return fmt.Errorf("dataplane write: %w", err)
		}
		start = end
	}
	return nil
}

// frameSize is the wire size of b's write frame.
func frameSize(b Block) int {
	return FrameHeader{Identity: b.Identity}.Size() + len(b.Data)
}

func (c *Client) writeBatch(ctx context.Context, blocks []Block) error {
	bufs := make(net.Buffers, 0, 2*len(blocks))
	headers := make([]byte, 0, (FrameHeaderSize+96)*len(blocks))
	var n int64
	for _, b := range blocks {
		at := len(headers)
		headers = AppendFrameHeader(headers, FrameHeader{
			Group: b.Group, Block: b.Block, Len: len(b.Data), Checksum: Checksum(b.Data), Identity: b.Identity,
		})
		n += int64(len(headers) - at + len(b.Data))
		bufs = append(bufs, headers[at:len(headers):len(headers)], b.Data)
	}
	resp, err := c.post(ctx, PathWrite, ContentTypeFrames, &bufs, n)
	if err != nil {
		return err
	}
	drain(resp.Body)
	return nil
}

// Read returns pool blocks' bytes, in the order asked (pd loads from a
// remote engine's worker, verification, tests). Each ref names the hash
// its block must hold; a block that does not hold it comes back with
// NotHeld set and no data, never with other bytes. Every block's checksum
// is verified; a mismatch is an ErrChecksum error.
func (c *Client) Read(ctx context.Context, refs []ReadRef) ([]ReadBlock, error) {
	if len(refs) == 0 {
		return []ReadBlock{}, nil
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

// ReadEach is Read that hands each block to use as its frame arrives
// instead of gathering them, so that a caller can move the bytes straight
// to where they go (a pd load writes them into its pool block): use gets
// the block's index in refs, the block without its bytes (NotHeld set for
// a refused one, which comes with no data), and for a held block its
// bytes as a FrameData, which use must read whole and then Verify before
// it trusts them. ReadEach drains what use left unread of a frame; an
// error from use, a protocol error or a checksum mismatch ends the stream
// and is returned (blocks already handed over stay handed over).
func (c *Client) ReadEach(ctx context.Context, refs []ReadRef, use func(i int, b ReadBlock, data *FrameData) error) error {
	if len(refs) == 0 {
		return nil
	}
	body, err := json.Marshal(ReadRequest{Blocks: refs})
	if err != nil {
		return fmt.Errorf("dataplane read: %w", err)
	}
	resp, err := c.post(ctx, PathRead, "application/json", bytes.NewReader(body), int64(len(body)))
	if err != nil {
		return fmt.Errorf("dataplane read: %w", err)
	}
	defer drain(resp.Body)
	if err := eachFrame(resp.Body, refs, use); err != nil {
		return fmt.Errorf("dataplane read: %w", err)
	}
	return nil
}

// readFrames reads one frame per ref, in order, then expects the end,
// gathering the blocks with their bytes.
func readFrames(r io.Reader, refs []ReadRef) ([]ReadBlock, error) {
	out := make([]ReadBlock, len(refs))
	err := eachFrame(r, refs, func(i int, b ReadBlock, data *FrameData) error {
		if data != nil {
			b.Data = make([]byte, data.Len())
			if _, err := io.ReadFull(data, b.Data); err != nil {
				return err
			}
			if err := data.Verify(); err != nil {
				return err
			}
		}
		out[i] = b
		return nil
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// eachFrame reads one frame per ref, in order, hands each to use, then
// expects the end. A frame that claims to hold another hash than asked is
// a protocol error.
func eachFrame(r io.Reader, refs []ReadRef, use func(i int, b ReadBlock, data *FrameData) error) error {
	for i, ref := range refs {
		h, err := ReadFrameHeader(r)
		if errors.Is(err, io.EOF) {
			return fmt.Errorf("stream ended after %d of %d blocks: %w", i, len(refs), ErrFrame)
		}
		if err != nil {
			return err
		}
		if h.Ref() != ref.BlockRef {
			return fmt.Errorf("frame %d is %+v, asked %+v: %w", i, h.Ref(), ref.BlockRef, ErrFrame)
		}
		if h.NotHeld {
			if h.Len != 0 {
				return fmt.Errorf("frame %d: a refused block with %d data bytes: %w", i, h.Len, ErrFrame)
			}
			if err := use(i, ReadBlock{Block: Block{BlockRef: ref.BlockRef}, NotHeld: NotHeldReason(ref.Hash, h.Identity, h.Generation)}, nil); err != nil {
				return err
			}
			continue
		}
		if h.Identity.Hash != ref.Hash {
			return fmt.Errorf("frame %d holds hash %q, asked %q: %w", i, h.Identity.Hash, ref.Hash, ErrFrame)
		}
		data := newFrameData(r, h)
		if err := use(i, ReadBlock{Block: Block{BlockRef: ref.BlockRef, Identity: h.Identity, Generation: h.Generation}}, data); err != nil {
			return err
		}
		if err := data.finish(); err != nil {
			return err
		}
	}
	var one [1]byte
	if n, _ := io.ReadFull(r, one[:]); n > 0 {
		return fmt.Errorf("data after the last frame: %w", ErrFrame)
	}
	return nil
}

// NotHeldReason describes a block that does not hold the hash want: held
// is what it holds instead (empty when nothing), gen its write generation.
func NotHeldReason(want string, held Identity, gen uint64) string {
	if held.Hash == "" {
		return fmt.Sprintf("block holds nothing (not written since the worker started, evicted, or its last write failed); wanted hash %s", want)
	}
	return fmt.Sprintf("block holds hash %s (request %q, generation %d); wanted hash %s", held.Hash, held.RequestID, gen, want)
}

// Evict tells the worker that the engine dropped the listed blocks'
// content (a block leaving the prefix cache to be reused): no read is
// served from them until they are written again. It returns how many of
// them held an identity.
func (c *Client) Evict(ctx context.Context, refs []BlockRef) (int, error) {
	if len(refs) == 0 {
		return 0, nil
	}
	body, err := json.Marshal(EvictRequest{Blocks: refs})
	if err != nil {
		return 0, fmt.Errorf("dataplane evict: %w", err)
	}
	resp, err := c.post(ctx, PathEvict, "application/json", bytes.NewReader(body), int64(len(body)))
	if err != nil {
		return 0, fmt.Errorf("dataplane evict: %w", err)
	}
	defer drain(resp.Body)
	var out EvictResponse
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil {
		return 0, fmt.Errorf("dataplane evict: answer: %w: %w", ErrUnavailable, err)
	}
	return out.Evicted, nil
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
