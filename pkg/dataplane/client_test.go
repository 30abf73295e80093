package dataplane_test

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
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

// frames is the read answer a worker gives for blocks, each holding its
// Identity.
func frames(blocks ...dataplane.Block) []byte {
	var out []byte
	for _, b := range blocks {
		out = dataplane.AppendFrameHeader(out, dataplane.FrameHeader{
			Group: b.Group, Block: b.Block, Len: len(b.Data), Checksum: dataplane.Checksum(b.Data),
			Generation: b.Generation, Identity: b.Identity,
		})
		out = append(out, b.Data...)
	}
	return out
}

// notHeldFrame is the frame of a refused block that holds held instead.
func notHeldFrame(ref dataplane.BlockRef, held dataplane.Identity, gen uint64) []byte {
	return dataplane.AppendFrameHeader(nil, dataplane.FrameHeader{Group: ref.Group, Block: ref.Block, NotHeld: true, Generation: gen, Identity: held})
}

func TestClientMapsAnswers(t *testing.T) {
	ref := dataplane.BlockRef{Group: 1, Block: 2}
	want := hash64("a")
	good := dataplane.Block{BlockRef: ref, Identity: dataplane.Identity{Hash: want}, Data: []byte("abcd")}
	corrupt := frames(good)
	corrupt[len(corrupt)-1] ^= 1
	otherHash := good
	otherHash.Identity = dataplane.Identity{Hash: hash64("b"), RequestID: "other"}
	notHeldWithData := dataplane.AppendFrameHeader(nil, dataplane.FrameHeader{
		Group: 1, Block: 2, NotHeld: true, Len: 4, Checksum: dataplane.Checksum([]byte("abcd")), Identity: otherHash.Identity,
	})
	notHeldWithData = append(notHeldWithData, "abcd"...)
	truncatedIdentity := frames(good)[:dataplane.FrameHeaderSize+3]
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
		{"another block's frame", http.StatusOK, frames(dataplane.Block{BlockRef: dataplane.BlockRef{Group: 1, Block: 3}, Identity: good.Identity, Data: []byte("abcd")}), dataplane.ErrFrame},
		{"a frame claiming another hash", http.StatusOK, frames(otherHash), dataplane.ErrFrame},
		{"a frame without a hash", http.StatusOK, frames(dataplane.Block{BlockRef: ref, Data: []byte("abcd")}), dataplane.ErrFrame},
		{"a not-held frame with data", http.StatusOK, notHeldWithData, dataplane.ErrFrame},
		{"a truncated identity", http.StatusOK, truncatedIdentity, dataplane.ErrFrame},
		{"a version 1 frame", http.StatusOK, append([]byte("KVB1"), frames(good)[4:]...), dataplane.ErrFrame},
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
			got, err := c.Read(context.Background(), []dataplane.ReadRef{{BlockRef: ref, Hash: want}})
			if !errors.Is(err, tc.want) {
				t.Fatalf("Read error = %v, want %v", err, tc.want)
			}
			if got != nil {
				t.Fatalf("Read returned blocks with an error: %+v", got)
			}
		})
	}
}

// TestClientReadServesHeldAndMarksRefused answers one served block and two
// refused ones (holding another hash; holding nothing): the served block
// carries its identity, generation and bytes, the refused ones NotHeld and
// no data, and the request named each block's hash.
func TestClientReadServesHeldAndMarksRefused(t *testing.T) {
	refs := []dataplane.ReadRef{
		{BlockRef: dataplane.BlockRef{Group: 0, Block: 1}, Hash: hash64("1")},
		{BlockRef: dataplane.BlockRef{Group: 1, Block: 2}, Hash: hash64("2")},
		{BlockRef: dataplane.BlockRef{Group: 0, Block: 3}, Hash: hash64("3")},
	}
	served := dataplane.Block{BlockRef: refs[0].BlockRef, Identity: dataplane.Identity{Hash: refs[0].Hash, RequestID: "req-a"}, Data: []byte("held bytes"), Generation: 77}
	other := dataplane.Identity{Hash: hash64("9"), RequestID: "req-b"}
	body := append(frames(served), notHeldFrame(refs[1].BlockRef, other, 78)...)
	body = append(body, notHeldFrame(refs[2].BlockRef, dataplane.Identity{}, 0)...)
	var asked dataplane.ReadRequest
	c := serve(t, func(w http.ResponseWriter, r *http.Request) {
		if err := json.NewDecoder(r.Body).Decode(&asked); err != nil {
			t.Errorf("request: %v", err)
		}
		_, _ = w.Write(body)
	})
	got, err := c.Read(context.Background(), refs)
	if err != nil {
		t.Fatal(err)
	}
	if len(asked.Blocks) != 3 || asked.Blocks[1] != refs[1] {
		t.Fatalf("request blocks %+v, want %+v", asked.Blocks, refs)
	}
	if len(got) != 3 {
		t.Fatalf("%d blocks for 3 refs", len(got))
	}
	if got[0].NotHeld != "" || got[0].BlockRef != served.BlockRef || got[0].Identity != served.Identity ||
		got[0].Generation != 77 || string(got[0].Data) != "held bytes" {
		t.Fatalf("served block %+v", got[0])
	}
	for i, wantIn := range map[int][]string{1: {refs[1].Hash, other.Hash, other.RequestID}, 2: {refs[2].Hash, "holds nothing"}} {
		b := got[i]
		if b.NotHeld == "" || b.Data != nil || b.BlockRef != refs[i].BlockRef {
			t.Fatalf("refused block %d: %+v", i, b)
		}
		for _, s := range wantIn {
			if !strings.Contains(b.NotHeld, s) {
				t.Fatalf("refused block %d: reason %q lacks %q", i, b.NotHeld, s)
			}
		}
	}
}

func TestClientPutChecksResultCount(t *testing.T) {
	var got dataplane.PutRequest
	c := serve(t, func(w http.ResponseWriter, r *http.Request) {
		_ = json.NewDecoder(r.Body).Decode(&got)
		_ = json.NewEncoder(w).Encode(dataplane.PutResponse{Results: []dataplane.PutResult{{Status: dataplane.PutStored}}})
	})
	items := []dataplane.PutItem{{BlockRef: dataplane.BlockRef{Group: 0, Block: 1}, Key: "k1", Hash: hash64("1"), RequestID: "req-1"}, {Key: "k2"}}
	if _, _, err := c.Put(context.Background(), items); !errors.Is(err, dataplane.ErrFrame) {
		t.Fatalf("Put with one result for two items: %v, want ErrFrame", err)
	}
	if len(got.Items) != 2 || got.Items[0] != items[0] || got.Items[1] != items[1] {
		t.Fatalf("request items = %+v, want %+v", got.Items, items)
	}
}

func TestClientSplitsLargeWrites(t *testing.T) {
	var requests, frameCount atomic.Int32
	var hashes atomic.Value
	hashes.Store("")
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
			if h.Identity.RequestID != "req" || h.Generation != 0 || h.NotHeld {
				t.Errorf("write frame %+v", h)
			}
			hashes.Store(hashes.Load().(string) + h.Identity.Hash[:1])
			frameCount.Add(1)
		}
	})
	blocks := make([]dataplane.Block, 5)
	for i := range blocks {
		blocks[i] = dataplane.Block{BlockRef: dataplane.BlockRef{Block: 0}, Identity: dataplane.Identity{Hash: hash64(string(rune('a' + i))), RequestID: "req"}, Data: make([]byte, 100)}
	}
	frame := dataplane.FrameHeaderSize + 64 + len("req") + 100
	c.WriteBatchBytes = 2 * frame // two whole frames, identity included
	if err := c.Write(context.Background(), blocks); err != nil {
		t.Fatal(err)
	}
	if requests.Load() != 3 || frameCount.Load() != 5 {
		t.Fatalf("%d requests carrying %d frames, want 3 and 5", requests.Load(), frameCount.Load())
	}
	if got := hashes.Load().(string); got != "abcde" {
		t.Fatalf("frames carried hashes %q, want abcde", got)
	}
	if err := c.Write(context.Background(), nil); err != nil || requests.Load() != 3 {
		t.Fatalf("empty Write: %v, %d requests", err, requests.Load())
	}
}

// TestClientWriteRequiresIdentity refuses, before sending anything, a
// write in which any block lacks a valid identity.
func TestClientWriteRequiresIdentity(t *testing.T) {
	var requests atomic.Int32
	c := serve(t, func(http.ResponseWriter, *http.Request) { requests.Add(1) })
	ok := dataplane.Block{Identity: dataplane.Identity{Hash: hash64("a")}, Data: []byte("x")}
	tests := []struct {
		name string
		bad  dataplane.Identity
	}{
		{"no hash", dataplane.Identity{RequestID: "req"}},
		{"hash too long", dataplane.Identity{Hash: strings.Repeat("a", dataplane.MaxHashLen+1)}},
		{"request id too long", dataplane.Identity{Hash: "ab", RequestID: strings.Repeat("r", dataplane.MaxRequestIDLen+1)}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			bad := ok
			bad.Identity = tc.bad
			if err := c.Write(context.Background(), []dataplane.Block{ok, bad}); !errors.Is(err, dataplane.ErrIdentity) {
				t.Fatalf("Write = %v, want ErrIdentity", err)
			}
		})
	}
	if n := requests.Load(); n != 0 {
		t.Fatalf("%d requests sent for invalid writes", n)
	}
}

func TestClientEvict(t *testing.T) {
	var got dataplane.EvictRequest
	var requests atomic.Int32
	c := serve(t, func(w http.ResponseWriter, r *http.Request) {
		requests.Add(1)
		if r.URL.Path != dataplane.PathEvict {
			t.Errorf("path %s", r.URL.Path)
		}
		_ = json.NewDecoder(r.Body).Decode(&got)
		_ = json.NewEncoder(w).Encode(dataplane.EvictResponse{Evicted: 1})
	})
	refs := []dataplane.BlockRef{{Group: 0, Block: 4}, {Group: 1, Block: 5}}
	n, err := c.Evict(context.Background(), refs)
	if err != nil || n != 1 {
		t.Fatalf("Evict = %d, %v; want 1", n, err)
	}
	if len(got.Blocks) != 2 || got.Blocks[0] != refs[0] || got.Blocks[1] != refs[1] {
		t.Fatalf("request blocks %+v", got.Blocks)
	}
	if n, err := c.Evict(context.Background(), nil); n != 0 || err != nil || requests.Load() != 1 {
		t.Fatalf("empty Evict = %d, %v after %d requests", n, err, requests.Load())
	}
	bad := serve(t, func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("not json")) })
	if _, err := bad.Evict(context.Background(), refs); !errors.Is(err, dataplane.ErrUnavailable) {
		t.Fatalf("Evict with an undecodable answer: %v", err)
	}
	rejected := serve(t, func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusBadRequest) })
	if _, err := rejected.Evict(context.Background(), refs); !errors.Is(err, dataplane.ErrRejected) {
		t.Fatalf("Evict answered 400: %v", err)
	}
}
