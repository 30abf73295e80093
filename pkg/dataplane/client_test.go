package dataplane_test

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"

	"github.com/kvmesh/kvmesh/pkg/dataplane"
)

// These tests pin the client's handling of answers a real worker cannot be
// made to give on demand (5xx, malformed streams). The client against a real
// gpuworker is tested in services/gpuworker/internal/app.

func serve(t *testing.T, h http.HandlerFunc) *dataplane.Client {
	t.Helper()
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return dataplane.NewClient(srv.URL+"/", srv.Client())
}

func frames(blocks ...dataplane.Block) []byte {
	var out []byte
	for _, b := range blocks {
		out = dataplane.AppendFrameHeader(out, dataplane.FrameHeader{
			Group: b.Group, Block: b.Block, Len: len(b.Data), Checksum: dataplane.Checksum(b.Data),
		})
		out = append(out, b.Data...)
	}
	return out
}

func TestClientMapsAnswers(t *testing.T) {
	ref := dataplane.BlockRef{Group: 1, Block: 2}
	good := dataplane.Block{BlockRef: ref, Data: []byte("abcd")}
	corrupt := frames(good)
	corrupt[len(corrupt)-1] ^= 1
	tests := []struct {
		name   string
		status int
		body   []byte
		want   error
	}{
		{"problem 400", http.StatusBadRequest, []byte(`{"title":"Bad Request","detail":"blocks[0]: out of range"}`), dataplane.ErrRejected},
		{"problem 503", http.StatusServiceUnavailable, []byte(`{"title":"store unavailable"}`), dataplane.ErrUnavailable},
		{"500 without a problem", http.StatusInternalServerError, []byte("oops"), dataplane.ErrUnavailable},
		{"stream ends early", http.StatusOK, nil, dataplane.ErrFrame},
		{"another block's frame", http.StatusOK, frames(dataplane.Block{BlockRef: dataplane.BlockRef{Group: 1, Block: 3}, Data: []byte("abcd")}), dataplane.ErrFrame},
		{"data after the last frame", http.StatusOK, append(frames(good), 0), dataplane.ErrFrame},
		{"corrupted data", http.StatusOK, corrupt, dataplane.ErrChecksum},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c := serve(t, func(w http.ResponseWriter, r *http.Request) {
				if r.URL.Path != dataplane.PathRead {
					t.Errorf("path %s", r.URL.Path)
				}
				w.WriteHeader(tc.status)
				_, _ = w.Write(tc.body)
			})
			if _, err := c.Read(context.Background(), []dataplane.BlockRef{ref}); !errors.Is(err, tc.want) {
				t.Fatalf("Read error = %v, want %v", err, tc.want)
			}
		})
	}
}

func TestClientPutChecksResultCount(t *testing.T) {
	var got dataplane.PutRequest
	c := serve(t, func(w http.ResponseWriter, r *http.Request) {
		_ = json.NewDecoder(r.Body).Decode(&got)
		_ = json.NewEncoder(w).Encode(dataplane.PutResponse{Results: []dataplane.PutResult{{Status: dataplane.PutStored}}})
	})
	items := []dataplane.PutItem{{BlockRef: dataplane.BlockRef{Group: 0, Block: 1}, Key: "k1"}, {Key: "k2"}}
	if _, _, err := c.Put(context.Background(), items); !errors.Is(err, dataplane.ErrFrame) {
		t.Fatalf("Put with one result for two items: %v, want ErrFrame", err)
	}
	if len(got.Items) != 2 || got.Items[0].Key != "k1" || got.Items[0].Block != 1 {
		t.Fatalf("request items = %+v", got.Items)
	}
}

func TestClientSplitsLargeWrites(t *testing.T) {
	var requests, frameCount atomic.Int32
	c := serve(t, func(w http.ResponseWriter, r *http.Request) {
		requests.Add(1)
		for {
			h, err := dataplane.ReadFrameHeader(r.Body)
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				t.Errorf("frame: %v", err)
				return
			}
			if err := dataplane.ReadFrameData(r.Body, h, make([]byte, h.Len)); err != nil {
				t.Errorf("data: %v", err)
				return
			}
			frameCount.Add(1)
		}
	})
	c.WriteBatchBytes = 2 * (dataplane.FrameHeaderSize + 100)
	blocks := make([]dataplane.Block, 5)
	for i := range blocks {
		blocks[i] = dataplane.Block{BlockRef: dataplane.BlockRef{Block: 0}, Data: make([]byte, 100)}
	}
	if err := c.Write(context.Background(), blocks); err != nil {
		t.Fatal(err)
	}
	if requests.Load() != 3 || frameCount.Load() != 5 {
		t.Fatalf("%d requests carrying %d frames, want 3 and 5", requests.Load(), frameCount.Load())
	}
	if err := c.Write(context.Background(), nil); err != nil || requests.Load() != 3 {
		t.Fatalf("empty Write: %v, %d requests", err, requests.Load())
	}
}
