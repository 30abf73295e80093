// Package dataplane is the contract for moving KV-block bytes between a
// gpuworker's paged pool and the store pool: the value framing stored in the
// store (EncodeValue, DecodeValue), the binary wire format of the data-plane
// HTTP routes (FrameHeader) and a Client for those routes. The workers
// it talks to are found in pkg/registry.
//
// Block bytes never travel through Kafka or PostgreSQL: the sender asks the
// owning worker to Put blocks to the store, and a worker's loads read the
// store (or, for pd loads, another worker through Client.Read) straight into
// its pool.
package dataplane

import (
	"errors"
	"fmt"

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
	// PathEvict takes a JSON EvictRequest: the engine drops those blocks'
	// content, and no read is served from them until they are rewritten.
	PathEvict = "/v1/dataplane/evict"
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

// MaxHashLen bounds an Identity's hash text (a SHA-256 chain hash is 64
// hex digits; engines may use their own, shorter or longer, hashes).
const MaxHashLen = 255

// MaxRequestIDLen bounds an Identity's request id.
const MaxRequestIDLen = 1024

// Identity is what a pool block holds: the hash of the chunk whose KV it
// is (lower-case hex, the hash that chunk's store key carries) and the
// request whose write (a compute or a load) put it there. The hash chains
// the whole prefix, so two blocks with the same hash (and group) hold the
// same bytes whichever request wrote them; the request id is recorded for
// diagnostics.
type Identity struct {
	// Hash is the chunk's block hash, lower-case hex.
	Hash string `json:"hash"`
	// RequestID is the request that wrote the block.
	RequestID string `json:"request_id,omitempty"`
}

// Validate reports an identity that cannot name a block's content.
func (id Identity) Validate() error {
	switch {
	case id.Hash == "":
		return fmt.Errorf("no block hash: %w", ErrIdentity)
	case len(id.Hash) > MaxHashLen:
		return fmt.Errorf("block hash of %d bytes over %d: %w", len(id.Hash), MaxHashLen, ErrIdentity)
	case len(id.RequestID) > MaxRequestIDLen:
		return fmt.Errorf("request id of %d bytes over %d: %w", len(id.RequestID), MaxRequestIDLen, ErrIdentity)
	}
	return nil
}

// Block is one pool block with its identity and bytes.
type Block struct {
	BlockRef
	// Identity is what the block holds; required for a write.
	Identity
	// Data is the block's bytes: exactly the group's bytes_per_block.
	Data []byte
	// Generation is the pool's write generation of the block (answers
	// only): it grows with every write of any block of the pool.
	Generation uint64
}

// ReadRef asks for one block and names the hash it must hold.
type ReadRef struct {
	BlockRef
	// Hash is the chunk hash (lower-case hex) the block must hold.
	Hash string `json:"hash"`
}

// ReadBlock is one block of a read answer.
type ReadBlock struct {
	Block
	// NotHeld, when set, says why the block was refused: it does not hold
	// the asked hash (never written since the worker started, evicted,
	// rewritten for other content, or its last write failed). Data is nil
	// then; the caller must treat the block as lost.
	NotHeld string
}

// EvictRequest is the JSON body of PathEvict.
type EvictRequest struct {
	// Blocks are the blocks whose content the engine drops.
	Blocks []BlockRef `json:"blocks"`
}

// EvictResponse is the JSON answer of PathEvict.
type EvictResponse struct {
	// Evicted counts the blocks that held an identity.
	Evicted int `json:"evicted"`
}

// PutItem asks the worker to store one pool block under a store key.
type PutItem struct {
	BlockRef
	// Key is the store key.
	Key string `json:"key"`
	// Hash is the chunk hash (lower-case hex) the block must hold; a block
	// that does not hold it is not stored (PutNotHeld).
	Hash string `json:"hash"`
	// RequestID is the saving request, for diagnostics.
	RequestID string `json:"request_id,omitempty"`
}

// PutStatus is the per-item outcome of a put.
type PutStatus string

// Put outcomes.
const (
	// PutStored: the value is in the store, written by this put.
	PutStored PutStatus = "stored"
	// PutExisting: the key was already in the store (another writer won
	// the race for it, kvstore.ErrExists); nothing was written.
	PutExisting PutStatus = "existing"
	// PutNoSpace: the store answered "no space" (kvstore.ErrNoSpace).
	PutNoSpace PutStatus = "no_space"
	// PutFailed: any other per-item failure (detail in Error).
	PutFailed PutStatus = "failed"
	// PutNotHeld: the block does not hold the item's hash (detail in
	// Error); nothing was stored. The save must not be retried from this
	// block: its bytes are gone.
	PutNotHeld PutStatus = "not_held"
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
	// Blocks are the blocks to read, in order; the answer has one frame
	// each (a refused block's frame has no data and FrameNotHeld set).
	Blocks []ReadRef `json:"blocks"`
}

// Sentinel errors.
var (
	// ErrFingerprint reports a stored value written under another model layout.
	ErrFingerprint = errors.New("dataplane: value fingerprint does not match the model")
	// ErrChecksum reports bytes whose checksum does not match.
	ErrChecksum = errors.New("dataplane: checksum mismatch")
	// ErrFrame reports a malformed value or wire frame.
	ErrFrame = errors.New("dataplane: malformed frame")
	// ErrRejected reports a data-plane request the worker refused as invalid
	// (a 4xx answer): retrying the same request will not help.
	ErrRejected = errors.New("dataplane: request rejected")
	// ErrUnavailable reports a worker that could not be reached or answered
	// 5xx: the request may succeed later.
	ErrUnavailable = errors.New("dataplane: worker unavailable")
	// ErrIdentity reports a block identity that is missing or malformed.
	ErrIdentity = errors.New("dataplane: invalid block identity")
)
