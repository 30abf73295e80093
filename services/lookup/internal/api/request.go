package api

import (
	"encoding/hex"
	"fmt"

	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/services/lookup/internal/connector"
)

// Limits on request fields (besides the body size limit).
const (
	// MaxIDBytes bounds engine_id, request_id and remote_engine_id.
	MaxIDBytes = 256
	// MaxHashBytes bounds one block hash (128 hex digits).
	MaxHashBytes = 64
)

// Request is the body of POST /v1/lookup. Exactly one of TokenIDs and
// BlockHashes must be given (a JSON null counts as absent). See API.md.
type Request struct {
	// EngineID identifies the engine asking (non-empty).
	EngineID string `json:"engine_id"`
	// RequestID identifies the request (non-empty); the decision is keyed by it.
	RequestID string `json:"request_id"`
	// Model must equal the served model's name.
	Model string `json:"model"`
	// TokenIDs are the request's tokens; the service hashes them with
	// kvcore.HashChain at the model's hash block size.
	TokenIDs []uint32 `json:"token_ids"`
	// Extra is the salt mixed into every block hash (its UTF-8 bytes):
	// LoRA id, multimodal hashes, cache salt. Only with TokenIDs.
	Extra *string `json:"extra"`
	// BlockHashes is the engine's own hash chain, hex, one per hash block:
	// at least NumTokens / hash_block_size of them (rounded down), all of
	// one length of 1 to MaxHashBytes bytes. Hashes past that count are
	// checked but not used.
	BlockHashes []string `json:"block_hashes"`
	// NumTokens is the request's token count: required with BlockHashes;
	// with TokenIDs it may be left out and must otherwise equal their count.
	NumTokens *int `json:"num_tokens"`
	// NumComputedTokens is what the engine already holds (0 ≤ it ≤ NumTokens).
	NumComputedTokens int `json:"num_computed_tokens"`
	// KVTransferParams is the disaggregated-prefill source for the pd child.
	KVTransferParams *contract.PDSource `json:"kv_transfer_params"`
	// LoadAsync overrides the service's KVMESH_LOAD_ASYNC for this request.
	LoadAsync *bool `json:"load_async"`
}

// FieldError is a request that does not validate: Field names the bad
// field (a JSON path such as "block_hashes[3]"), Detail says why.
type FieldError struct {
	// Field is the JSON path of the offending field.
	Field string
	// Detail explains the problem to the client.
	Detail string
}

func (e *FieldError) Error() string { return e.Field + ": " + e.Detail }

func fieldErr(field, format string, args ...any) *FieldError {
	return &FieldError{Field: field, Detail: fmt.Sprintf(format, args...)}
}

// Validator turns requests into connector queries for one model.
type Validator struct {
	// Model is the served model.
	Model *kvcore.Model
	// LoadAsync is the default for requests without load_async.
	LoadAsync bool
}

// Query validates req and returns its query, or a *FieldError naming the
// first bad field.
func (v Validator) Query(req *Request) (*connector.Query, error) {
	if err := v.checkIdentity(req); err != nil {
		return nil, err
	}
	q := &connector.Query{EngineID: req.EngineID, RequestID: req.RequestID, LoadAsync: v.LoadAsync}
	if req.LoadAsync != nil {
		q.LoadAsync = *req.LoadAsync
	}
	var err *FieldError
	switch {
	case req.TokenIDs != nil && req.BlockHashes != nil:
		return nil, fieldErr("token_ids", "give either token_ids or block_hashes, not both")
	case req.TokenIDs == nil && req.BlockHashes == nil:
		return nil, fieldErr("token_ids", "one of token_ids or block_hashes is required")
	case req.TokenIDs != nil:
		err = v.fromTokens(req, q)
	default:
		err = v.fromHashes(req, q)
	}
	if err != nil {
		return nil, err
	}
	if err := checkComputed(req.NumComputedTokens, q.NumTokens); err != nil {
		return nil, err
	}
	if req.KVTransferParams != nil {
		if err := v.checkTransfer(req.KVTransferParams); err != nil {
			return nil, err
		}
		q.Transfer = normalizeTransfer(req.KVTransferParams)
	}
	q.NumComputedTokens = req.NumComputedTokens
	return q, nil
}

// checkIdentity checks the ids and the model name.
func (v Validator) checkIdentity(req *Request) error {
	if err := checkID("engine_id", req.EngineID); err != nil {
		return err
	}
	if err := checkID("request_id", req.RequestID); err != nil {
		return err
	}
	if req.Model != v.Model.Name {
		return fieldErr("model", "model %q is not served here; this lookup serves %q", req.Model, v.Model.Name)
	}
	return nil
}

func checkID(field, id string) *FieldError {
	switch {
	case id == "":
		return fieldErr(field, "is required")
	case len(id) > MaxIDBytes:
		return fieldErr(field, "is %d bytes, at most %d allowed", len(id), MaxIDBytes)
	}
	return nil
}

// fromTokens hashes the token ids.
func (v Validator) fromTokens(req *Request, q *connector.Query) *FieldError {
	n := len(req.TokenIDs)
	if req.NumTokens != nil && *req.NumTokens != n {
		return fieldErr("num_tokens", "is %d but token_ids holds %d tokens", *req.NumTokens, n)
	}
	var extra []byte
	if req.Extra != nil {
		extra = []byte(*req.Extra)
	}
	q.NumTokens = n
	q.Hashes = kvcore.HashChain(req.TokenIDs, v.Model.HashBlockSize, extra)
	return nil
}

// fromHashes decodes the engine's hash chain.
func (v Validator) fromHashes(req *Request, q *connector.Query) *FieldError {
	if req.Extra != nil {
		return fieldErr("extra", "only applies to token_ids; block_hashes already include the salt")
	}
	if req.NumTokens == nil {
		return fieldErr("num_tokens", "is required with block_hashes")
	}
	n := *req.NumTokens
	if n < 0 {
		return fieldErr("num_tokens", "is %d, must not be negative", n)
	}
	need := n / v.Model.HashBlockSize
	if len(req.BlockHashes) < need {
		return fieldErr("block_hashes", "has %d hashes; %d tokens at hash block size %d need at least %d",
			len(req.BlockHashes), n, v.Model.HashBlockSize, need)
	}
	hashes, err := decodeHashes(req.BlockHashes)
	if err != nil {
		return err
	}
	q.NumTokens, q.Hashes = n, hashes[:need]
	return nil
}

// decodeHashes decodes hex hashes that must all have the first one's length.
func decodeHashes(hexes []string) ([]kvcore.BlockHash, *FieldError) {
	out := make([]kvcore.BlockHash, len(hexes))
	for i, s := range hexes {
		field := fmt.Sprintf("block_hashes[%d]", i)
		b, err := hex.DecodeString(s)
		switch {
		case err != nil:
			return nil, fieldErr(field, "is not hex: %v", err)
		case len(b) == 0:
			return nil, fieldErr(field, "is empty")
		case len(b) > MaxHashBytes:
			return nil, fieldErr(field, "is %d bytes, at most %d allowed", len(b), MaxHashBytes)
		case i > 0 && len(b) != len(out[0]):
			return nil, fieldErr(field, "is %d bytes but block_hashes[0] is %d: every hash must have one length", len(b), len(out[0]))
		}
		out[i] = b
	}
	return out, nil
}

func checkComputed(computed, numTokens int) *FieldError {
	switch {
	case computed < 0:
		return fieldErr("num_computed_tokens", "is %d, must not be negative", computed)
	case computed > numTokens:
		return fieldErr("num_computed_tokens", "is %d, more than the request's %d tokens", computed, numTokens)
	}
	return nil
}

// checkTransfer checks the pd source: an engine, a non-negative token
// count, a non-negative remote_null_block_id when given, and one block
// table per KV group with valid block ids (or null).
func (v Validator) checkTransfer(p *contract.PDSource) *FieldError {
	const base = "kv_transfer_params."
	if err := checkID(base+"remote_engine_id", p.EngineID); err != nil {
		return err
	}
	if p.Tokens < 0 {
		return fieldErr(base+"remote_tokens", "is %d, must not be negative", p.Tokens)
	}
	if p.NullBlockID != nil && *p.NullBlockID < 0 {
		return fieldErr(base+"remote_null_block_id", "is %d, must not be negative (leave it out when null blocks are null)", *p.NullBlockID)
	}
	if len(p.BlockTable) != len(v.Model.Groups) {
		return fieldErr(base+"remote_block_table", "has %d groups, model %s has %d",
			len(p.BlockTable), v.Model.Name, len(v.Model.Groups))
	}
	for g, ids := range p.BlockTable {
		for i, id := range ids {
			if id < kvcore.NullBlock {
				return fieldErr(fmt.Sprintf("%sremote_block_table[%d][%d]", base, g, i), "is %d, block ids are ≥ 0 or null", id)
			}
		}
	}
	return nil
}

// normalizeTransfer returns the pd source with the remote engine's declared
// null block id (remote_null_block_id; vLLM's is 0) turned into null in its
// table, once, here at the edge: the decision, the scheduler and the load
// task only know kvcore.NullBlock. A source without a declaration is
// returned as it is.
func normalizeTransfer(p *contract.PDSource) *contract.PDSource {
	if p.NullBlockID == nil {
		return p
	}
	out := *p
	out.BlockTable = p.BlockTable.NormalizeNull(kvcore.EngineNullBlock(p.NullBlockID))
	out.NullBlockID = nil
	return &out
}
