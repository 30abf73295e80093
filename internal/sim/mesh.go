package sim

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	"github.com/kvmesh/kvmesh/pkg/contract"
)

// lookupRequest is the body of POST /v1/lookup as the engine sends it: the
// engine's own hash chain, never token ids.
type lookupRequest struct {
	EngineID          string             `json:"engine_id"`
	RequestID         string             `json:"request_id"`
	Model             string             `json:"model"`
	BlockHashes       []string           `json:"block_hashes"`
	NumTokens         int                `json:"num_tokens"`
	NumComputedTokens int                `json:"num_computed_tokens"`
	KVTransferParams  *contract.PDSource `json:"kv_transfer_params,omitempty"`
}

// lookupClient calls the lookup service.
type lookupClient struct {
	base string
	hc   *http.Client
}

// lookup asks for the request's external tokens. A 503 or a transport
// failure is ErrLookupUnavailable; any other non-200 answer is
// ErrLookupRejected with the problem detail.
func (c *lookupClient) lookup(ctx context.Context, req lookupRequest) (*contract.LookupDecision, error) {
	body, err := json.Marshal(req)
	if err != nil {
		return nil, fmt.Errorf("lookup %s: %w", req.RequestID, err)
	}
	hr, err := http.NewRequestWithContext(ctx, http.MethodPost, c.base+"/v1/lookup", bytes.NewReader(body))
	if err != nil {
		return nil, fmt.Errorf("lookup %s: %w", req.RequestID, err)
	}
	hr.Header.Set("Content-Type", "application/json")
	resp, err := c.hc.Do(hr)
	if err != nil {
		return nil, fmt.Errorf("lookup %s: %w: %w", req.RequestID, ErrLookupUnavailable, err)
	}
	defer drainClose(resp.Body)
	switch {
	case resp.StatusCode == http.StatusOK:
	case resp.StatusCode == http.StatusServiceUnavailable || resp.StatusCode >= 500:
		return nil, fmt.Errorf("lookup %s: %d %s: %w", req.RequestID, resp.StatusCode, problemText(resp.Body), ErrLookupUnavailable)
	default:
		return nil, fmt.Errorf("lookup %s: %d %s: %w", req.RequestID, resp.StatusCode, problemText(resp.Body), ErrLookupRejected)
	}
	var d contract.LookupDecision
	if err := json.NewDecoder(resp.Body).Decode(&d); err != nil {
		return nil, fmt.Errorf("lookup %s: decode answer: %w: %w", req.RequestID, ErrLookupUnavailable, err)
	}
	return &d, nil
}

// getJSON fetches url into out.
func getJSON(ctx context.Context, hc *http.Client, url string, out any) error {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := hc.Do(req)
	if err != nil {
		return fmt.Errorf("GET %s: %w", url, err)
	}
	defer drainClose(resp.Body)
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %d %s: %w", url, resp.StatusCode, problemText(resp.Body), ErrHTTP)
	}
	if err := json.NewDecoder(resp.Body).Decode(out); err != nil {
		return fmt.Errorf("GET %s: decode: %w", url, err)
	}
	return nil
}

// problemText extracts the detail of a problem+json body, or a short excerpt.
func problemText(r io.Reader) string {
	b, _ := io.ReadAll(io.LimitReader(r, 8<<10))
	var p struct {
		Title  string `json:"title"`
		Detail string `json:"detail"`
	}
	if json.Unmarshal(b, &p) == nil && (p.Detail != "" || p.Title != "") {
		return strings.TrimSpace(p.Title + ": " + p.Detail)
	}
	return strings.TrimSpace(string(b))
}

func drainClose(rc io.ReadCloser) {
	_, _ = io.Copy(io.Discard, io.LimitReader(rc, 64<<10))
	_ = rc.Close()
}
