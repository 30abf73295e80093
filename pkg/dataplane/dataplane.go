// Package dataplane is the contract for moving KV-block bytes between a
// gpuworker's paged pool and the store pool: the value framing stored in the
// store (EncodeValue, DecodeValue), the binary wire format of the data-plane
// HTTP routes (FrameHeader), a Client for those routes, and the worker
// registry in PostgreSQL (Register, Heartbeat, Find).
//
// Block bytes never travel through Kafka or PostgreSQL: the sender asks the
// owning worker to Put blocks to the store, and a worker's loads read the
// store (or, for pd loads, another worker through Client.Read) straight into
// its pool.
package dataplane

import (
	"errors"

	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// Routes of a gpuworker's data plane.
const (
	// PathWrite takes a binary frame stream and writes each block into the pool.
	PathWrite = "/v1/dataplane/write"
	// PathRead takes a JSON ReadRequest and answers a binary frame stream.
	PathRead = "/v1/dataplane/read"
	// PathPut takes a JSON PutRequest and answers a JSON PutResponse.
	PathPut = "/v1/dataplane/put"
	// ContentTypeFrames is the media type of a binary frame stream.
	ContentTypeFrames = "application/vnd.kvmesh.blocks"
)

// BlockRef names one block of one KV group in an engine rank's pool.
type BlockRef struct {
	// Group is the KV-group index.
	Group int `json:"group"`
	// Block is the block id within the group's pool.
	Block kvcore.BlockID `json:"block"`
}

// Block is one pool block with its bytes.
type Block struct {
	BlockRef
	// Data is the block's bytes: exactly the group's bytes_per_block.
	Data []byte
}

// PutItem asks the worker to store one pool block under a store key.
type PutItem struct {
	BlockRef
	// Key is the store key.
	Key string `json:"key"`
}

// PutStatus is the per-item outcome of a put.
type PutStatus string

// Put outcomes.
const (
	// PutStored: the value is in the store.
	PutStored PutStatus = "stored"
	// PutNoSpace: the store answered "no space" (kvstore.ErrNoSpace).
	PutNoSpace PutStatus = "no_space"
	// PutFailed: any other per-item failure (detail in Error).
	PutFailed PutStatus = "failed"
)

// PutResult is the outcome of one PutItem.
type PutResult struct {
	// Status is the outcome.
	Status PutStatus `json:"status"`
	// Error explains a failure.
	Error string `json:"error,omitempty"`
}

// PutRequest is the JSON body of PathPut.
type PutRequest struct {
	// Items are the blocks to store, in order.
	Items []PutItem `json:"items"`
}

// PutResponse is the JSON answer of PathPut.
type PutResponse struct {
	// Results answer Items one for one, in order.
	Results []PutResult `json:"results"`
	// Bytes is the number of framed value bytes stored.
	Bytes int64 `json:"bytes"`
}

// ReadRequest is the JSON body of PathRead.
type ReadRequest struct {
	// Blocks are the blocks to read, in order; the answer has one frame each.
	Blocks []BlockRef `json:"blocks"`
}

// Sentinel errors.
var (
	// ErrFingerprint reports a stored value written under another model layout.
	ErrFingerprint = errors.New("dataplane: value fingerprint does not match the model")
	// ErrChecksum reports bytes whose checksum does not match.
	ErrChecksum = errors.New("dataplane: checksum mismatch")
	// ErrFrame reports a malformed value or wire frame.
	ErrFrame = errors.New("dataplane: malformed frame")
	// ErrNoWorker reports that no live gpuworker is registered for an engine
	// (or rank).
	ErrNoWorker = errors.New("no live gpuworker for engine")
	// ErrRejected reports a data-plane request the worker refused as invalid
	// (a 4xx answer): retrying the same request will not help.
	ErrRejected = errors.New("dataplane: request rejected")
	// ErrUnavailable reports a worker that could not be reached or answered
	// 5xx: the request may succeed later.
	ErrUnavailable = errors.New("dataplane: worker unavailable")
)
