package sim

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
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
	Tenant            string             `json:"tenant,omitempty"`
	BlockHashes       []string           `json:"block_hashes"`
	NumTokens         int                `json:"num_tokens"`
	NumComputedTokens int                `json:"num_computed_tokens"`
	KVTransferParams  *contract.PDSource `json:"kv_transfer_params,omitempty"`
}

// lookupClient calls the lookup service, failing over between its
// replicas.
type lookupClient struct {
	reps *replicas
	hc   *http.Client
}

func newLookupClient(urls []string, hc *http.Client) *lookupClient {
	return &lookupClient{reps: newReplicas(urls), hc: hc}
}

// lookup asks for the request's external tokens, trying the next replica
// when one answers 5xx or not at all. Such a failure on every replica is
// ErrLookupUnavailable; any other non-200 answer is ErrLookupRejected with
// the problem detail.
func (c *lookupClient) lookup(ctx context.Context, req lookupRequest) (*contract.LookupDecision, error) {
	body, err := json.Marshal(req)
	if err != nil {
		return nil, fmt.Errorf("lookup %s: %w", req.RequestID, err)
	}
	var d *contract.LookupDecision
	err = c.reps.do(ctx, func(err error) bool { return errors.Is(err, ErrLookupUnavailable) }, func(base string) error {
		var err error
		d, err = c.lookupAt(ctx, base, req.RequestID, body)
		return err
	})
	return d, err
}

// lookupAt asks one replica.
func (c *lookupClient) lookupAt(ctx context.Context, base, id string, body []byte) (*contract.LookupDecision, error) {
	hr, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/lookup", bytes.NewReader(body))
	if err != nil {
		return nil, fmt.Errorf("lookup %s: %w", id, err)
	}
	hr.Header.Set("Content-Type", "application/json")
	resp, err := c.hc.Do(hr)
	if err != nil {
		return nil, fmt.Errorf("lookup %s: %w: %w", id, ErrLookupUnavailable, err)
	}
	defer drainClose(resp.Body)
	switch {
	case resp.StatusCode == http.StatusOK:
	case resp.StatusCode >= 500:
		return nil, fmt.Errorf("lookup %s at %s: %d %s: %w", id, base, resp.StatusCode, problemText(resp.Body), ErrLookupUnavailable)
	default:
		return nil, fmt.Errorf("lookup %s at %s: %d %s: %w", id, base, resp.StatusCode, problemText(resp.Body), ErrLookupRejected)
	}
	var d contract.LookupDecision
	if err := json.NewDecoder(resp.Body).Decode(&d); err != nil {
		return nil, fmt.Errorf("lookup %s: decode answer: %w: %w", id, ErrLookupUnavailable, err)
	}
	return &d, nil
}

// getJSON fetches url into out. A connection error, a time-out or a 5xx
// is errReplicaDown.
func getJSON(ctx context.Context, hc *http.Client, url string, out any) error {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := hc.Do(req)
	if err != nil {
		return fmt.Errorf("GET %s: %w: %w", url, errReplicaDown, err)
	}
	defer drainClose(resp.Body)
	switch {
	case resp.StatusCode >= 500:
		return fmt.Errorf("GET %s: %d %s: %w: %w", url, resp.StatusCode, problemText(resp.Body), ErrHTTP, errReplicaDown)
	case resp.StatusCode == http.StatusNotFound:
		return fmt.Errorf("GET %s: %d %s: %w: %w", url, resp.StatusCode, problemText(resp.Body), ErrHTTP, errNotFound)
	case resp.StatusCode != http.StatusOK:
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
