package dataplaneapi_test

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/go-chi/chi/v5"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/services/gpuworker/internal/dataplaneapi"
	"github.com/kvmesh/kvmesh/services/gpuworker/internal/metrics"
	"github.com/kvmesh/kvmesh/services/gpuworker/internal/pool"
)

// TestReadAnswerLength: a read answer that fits the whole-answer bound
// goes out with a Content-Length, a larger one chunked; either way every
// held block comes back whole and verified and a refused one not held.
func TestReadAnswerLength(t *testing.T) {
	m, err := kvcore.ParseModel([]byte(`
name: read-test
hash_block_size: 16
groups:
  - {kind: full_attention, block_size: 16, bytes_per_block: 1048576}
`))
	if err != nil {
		t.Fatal(err)
	}
	p, err := pool.New(m, 12)
	if err != nil {
		t.Fatal(err)
	}
	met, err := metrics.New(prometheus.NewRegistry(), func() []pool.GroupStats { return nil }, nil)
	if err != nil {
		t.Fatal(err)
	}
	r := chi.NewRouter()
	dataplaneapi.New(p, nil, m.Fingerprint(), 4<<20, met).Mount(r)
	srv := httptest.NewServer(r)
	t.Cleanup(srv.Close)
	hash := func(b int) string { return strings.Repeat(string(rune('a'+b)), 64) }
	content := func(b int) []byte { return bytes.Repeat([]byte{byte(b), byte(b * 7)}, 1<<19) }
	for b := range 11 { // block 11 holds nothing
		if err := p.WriteBytes(0, kvcore.BlockID(b), dataplane.Identity{Hash: hash(b), RequestID: "w"}, content(b)); err != nil {
			t.Fatal(err)
		}
	}
	refs := func(n int) []dataplane.ReadRef {
		out := make([]dataplane.ReadRef, n)
		for b := range n {
			out[b] = dataplane.ReadRef{BlockRef: dataplane.BlockRef{Group: 0, Block: kvcore.BlockID(b)}, Hash: hash(b)}
		}
		out[n-1].Block = 11 // not held
		return out
	}
	for _, tc := range []struct {
		name    string
		blocks  int
		chunked bool
	}{{"small answer with a length", 3, false}, {"large answer chunked", 12, true}} {
		t.Run(tc.name, func(t *testing.T) {
			body, _ := json.Marshal(dataplane.ReadRequest{Blocks: refs(tc.blocks)})
			resp, err := http.Post(srv.URL+dataplane.PathRead, "application/json", bytes.NewReader(body))
			if err != nil {
				t.Fatal(err)
			}
			_ = resp.Body.Close()
			if chunked := len(resp.TransferEncoding) > 0; chunked != tc.chunked || (!chunked && resp.ContentLength <= 0) {
				t.Fatalf("transfer encoding %v, content length %d; want chunked %v", resp.TransferEncoding, resp.ContentLength, tc.chunked)
			}
			got, err := dataplane.NewClient(srv.URL, nil).Read(context.Background(), refs(tc.blocks))
			if err != nil {
				t.Fatal(err)
			}
			for b, rb := range got[:tc.blocks-1] {
				if rb.NotHeld != "" || !bytes.Equal(rb.Data, content(b)) {
					t.Fatalf("block %d: not held %q, %d bytes", b, rb.NotHeld, len(rb.Data))
				}
			}
			if got[tc.blocks-1].NotHeld == "" {
				t.Fatal("a block holding nothing was served")
			}
		})
	}
}
