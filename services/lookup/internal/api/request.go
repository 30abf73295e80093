package api

import (
	"encoding/base64"
	"fmt"
	"strings"

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

// Request is the body of POST /v1/lookup. Exactly one of TokenIDs,
// BlockHashes and BlockHashesB64 must be given (a JSON null counts as
// absent). See API.md.
type Request struct {
	// EngineID identifies the engine asking (non-empty).
	EngineID string `json:"engine_id"`
	// RequestID identifies the request (non-empty); the decision is keyed by it.
	RequestID string `json:"request_id"`
	// Model must equal the served model's name.
	Model string `json:"model"`
	// Tenant is the request's tenant (vLLM's cache_salt plays this role):
	// the lookup checks only the tenant's own store keys, and the decision
	// names it. Empty (or absent) is no tenant: the keys vLLM writes. A
	// non-empty tenant is 1 to kvcore.MaxTenantBytes bytes of
	// [A-Za-z0-9._-] (kvcore.ValidateTenant).
	Tenant string `json:"tenant"`
	// EngineVersion is the engine's version (vLLM's __version__), optional:
	// when the served model's spec pins an engine version and the engine
	// states another, the lookup is refused (kvcore.Model.CheckEngineVersion):
	// the store's blocks are the pinned version's.
	EngineVersion string `json:"engine_version"`
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
	// BlockHashesB64 is the compact form of BlockHashes, the one a fast
	// engine sends: the padded standard base64 (RFC 4648 §4, no line
	// breaks) of the raw hashes concatenated, each BlockHashBytes long, at
	// least NumTokens / hash_block_size of them. Hashes past that count
	// are not used.
	BlockHashesB64 *string `json:"block_hashes_b64"`
	// BlockHashBytes is the length of every hash in BlockHashesB64, 1 to
	// MaxHashBytes: required with it, refused without it.
	BlockHashBytes *int `json:"block_hash_bytes"`
	// NumTokens is the request's token count: required with BlockHashes;
	// with TokenIDs it may be left out and must otherwise equal their count.
	NumTokens *int `json:"num_tokens"`
	// NumComputedTokens is what the engine already holds (0 ≤ it ≤ NumTokens).
	NumComputedTokens int `json:"num_computed_tokens"`
	// KVTransferParams is the disaggregated-prefill source for the pd child.
	KVTransferParams *contract.PDSource `json:"kv_transfer_params"`
	// LoadAsync overrides the service's KVMESH_LOAD_ASYNC for this request.
	LoadAsync *bool `json:"load_async"`

	// binary is set for a ContentTypeBinary body, whose hashes, raw and
	// concatenated, are rawHashes.
	binary    bool
	rawHashes []byte
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
	q := &connector.Query{EngineID: req.EngineID, RequestID: req.RequestID, Tenant: req.Tenant, LoadAsync: v.LoadAsync}
	if req.LoadAsync != nil {
		q.LoadAsync = *req.LoadAsync
	}
	if err := v.hashInput(req, q); err != nil {
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

// checkIdentity checks the ids, the tenant and the model name.
func (v Validator) checkIdentity(req *Request) error {
	if err := checkID("engine_id", req.EngineID); err != nil {
		return err
	}
	if err := checkID("request_id", req.RequestID); err != nil {
		return err
	}
	return v.checkScope(req)
}

// checkScope checks the tenant, the model name and the engine version.
func (v Validator) checkScope(req *Request) error {
	if err := kvcore.ValidateTenant(req.Tenant); err != nil {
		return fieldErr("tenant", "is not a valid tenant: at most %d bytes of [A-Za-z0-9._-]", kvcore.MaxTenantBytes)
	}
	if req.Model != v.Model.Name {
		return fieldErr("model", "model %q is not served here; this lookup serves %q", req.Model, v.Model.Name)
	}
	if err := v.Model.CheckEngineVersion(req.EngineVersion); err != nil {
		return fieldErr("engine_version", "%v", err)
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

// hashInput fills q's token count and hash chain from the one hash input
// req carries: token_ids, block_hashes, block_hashes_b64 or the hashes of
// a binary body.
func (v Validator) hashInput(req *Request, q *connector.Query) *FieldError {
	switch {
	case req.binary:
		if f := chainField(req); f != "" {
			return fieldErr(f, "a binary lookup carries its hashes after the head, which must not carry %s", f)
		}
		return v.fromRaw(req, q, FieldBinaryHashes, req.rawHashes)
	case req.TokenIDs != nil && req.BlockHashes != nil:
		return fieldErr("token_ids", "give either token_ids or block_hashes, not both")
	case req.BlockHashesB64 != nil && (req.TokenIDs != nil || req.BlockHashes != nil):
		return fieldErr("block_hashes_b64", "give one of token_ids, block_hashes and block_hashes_b64, not both block_hashes_b64 and another")
	case req.BlockHashBytes != nil && req.BlockHashesB64 == nil:
		return fieldErr("block_hash_bytes", "only applies to block_hashes_b64 and the binary body")
	case req.TokenIDs != nil:
		return v.fromTokens(req, q)
	case req.BlockHashes != nil:
		return v.fromHashes(req, q)
	case req.BlockHashesB64 != nil:
		raw, err := decodeB64(*req.BlockHashesB64)
		if err != nil {
			return err
		}
		return v.fromRaw(req, q, "block_hashes_b64", raw)
	}
	return fieldErr("token_ids", "one of token_ids, block_hashes or block_hashes_b64 is required")
}

// chainField names a hash chain given in the JSON fields, "" when none is.
func chainField(req *Request) string {
	switch {
	case req.TokenIDs != nil:
		return "token_ids"
	case req.BlockHashes != nil:
		return "block_hashes"
	case req.BlockHashesB64 != nil:
		return "block_hashes_b64"
	}
	return ""
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

// fromHashes decodes the engine's hash chain, given in hex.
func (v Validator) fromHashes(req *Request, q *connector.Query) *FieldError {
	need, err := v.needHashes(req, "block_hashes")
	if err != nil {
		return err
	}
	if len(req.BlockHashes) < need {
		return tooFew("block_hashes", len(req.BlockHashes), *req.NumTokens, v.Model.HashBlockSize, need)
	}
	hashes, err := decodeHashes(req.BlockHashes)
	if err != nil {
		return err
	}
	q.NumTokens, q.Hashes = *req.NumTokens, hashes[:need]
	return nil
}

// decodeB64 decodes block_hashes_b64: padded standard base64 only (the
// decoder would skip line breaks; they are refused).
func decodeB64(s string) ([]byte, *FieldError) {
	if strings.ContainsAny(s, "\r\n") {
		return nil, fieldErr("block_hashes_b64", "is not base64: line breaks are not allowed")
	}
	raw, err := base64.StdEncoding.Strict().DecodeString(s)
	if err != nil {
		return nil, fieldErr("block_hashes_b64", "is not padded standard base64: %v", err)
	}
	return raw, nil
}

// fromRaw takes the engine's hash chain from raw, the hashes concatenated
// (field names them in errors): the hashes are sliced from raw, with no
// allocation per hash.
func (v Validator) fromRaw(req *Request, q *connector.Query, field string, raw []byte) *FieldError {
	need, err := v.needHashes(req, field)
	if err != nil {
		return err
	}
	size, err := hashSize(req.BlockHashBytes, field)
	if err != nil {
		return err
	}
	if len(raw)%size != 0 {
		return fieldErr(field, "holds %d bytes, not a whole number of %d-byte hashes (block_hash_bytes)", len(raw), size)
	}
	if n := len(raw) / size; n < need {
		return tooFew(field, n, *req.NumTokens, v.Model.HashBlockSize, need)
	}
	hashes := make([]kvcore.BlockHash, need)
	for i := range hashes {
		hashes[i] = raw[i*size : (i+1)*size : (i+1)*size]
	}
	q.NumTokens, q.Hashes = *req.NumTokens, hashes
	return nil
}

// needHashes checks what a hash-chain input requires besides the chain
// (num_tokens, no extra) and returns how many hashes it must hold.
func (v Validator) needHashes(req *Request, field string) (int, *FieldError) {
	if req.Extra != nil {
		return 0, fieldErr("extra", "only applies to token_ids; %s already include the salt", field)
	}
	if req.NumTokens == nil {
		return 0, fieldErr("num_tokens", "is required with %s", field)
	}
	if n := *req.NumTokens; n < 0 {
		return 0, fieldErr("num_tokens", "is %d, must not be negative", n)
	}
	return *req.NumTokens / v.Model.HashBlockSize, nil
}

// hashSize checks block_hash_bytes, which the chain in field needs.
func hashSize(size *int, field string) (int, *FieldError) {
	switch {
	case size == nil:
		return 0, fieldErr("block_hash_bytes", "is required with %s", field)
	case *size < 1 || *size > MaxHashBytes:
		return 0, fieldErr("block_hash_bytes", "is %d, must be 1 to %d", *size, MaxHashBytes)
	}
	return *size, nil
}

func tooFew(field string, have, numTokens, hashBlockSize, need int) *FieldError {
	return fieldErr(field, "has %d hashes; %d tokens at hash block size %d need at least %d",
		have, numTokens, hashBlockSize, need)
}

// decodeHashes decodes hex hashes that must all have the first one's
// length into one buffer, the hashes sliced from it. The first bad hash
// is named in the error.
func decodeHashes(hexes []string) ([]kvcore.BlockHash, *FieldError) {
	out := make([]kvcore.BlockHash, len(hexes))
	if len(hexes) == 0 {
		return out, nil
	}
	if err := checkHex(0, hexes[0], 0); err != nil {
		return nil, err
	}
	size := len(hexes[0]) / 2
	buf := make([]byte, len(hexes)*size)
	for i, s := range hexes {
		b := buf[i*size : (i+1)*size : (i+1)*size]
		if len(s) != 2*size || !decodeHex(b, s) {
			return nil, checkHex(i, s, size)
		}
		out[i] = b
	}
	return out, nil
}

// checkHex explains why hex hash i (s) is bad, where size is the length
// every hash must have (0 for the first hash); nil when it is good.
func checkHex(i int, s string, size int) *FieldError {
	field := fmt.Sprintf("block_hashes[%d]", i)
	b := make([]byte, len(s)/2)
	switch {
	case len(s)%2 != 0 || !decodeHex(b, s[:2*len(b)]):
		return fieldErr(field, "is not hex")
	case len(b) == 0:
		return fieldErr(field, "is empty")
	case len(b) > MaxHashBytes:
		return fieldErr(field, "is %d bytes, at most %d allowed", len(b), MaxHashBytes)
	case size > 0 && len(b) != size:
		return fieldErr(field, "is %d bytes but block_hashes[0] is %d: every hash must have one length", len(b), size)
	}
	return nil
}

// hexValue maps an ASCII byte to its hex digit value, 0xff for a byte that
// is no hex digit (either case is accepted).
var hexValue = func() (t [256]byte) {
	for i := range t {
		t[i] = 0xff
	}
	for i, c := range "0123456789abcdef" {
		t[c] = byte(i)
	}
	for i, c := range "ABCDEF" {
		t[c] = byte(10 + i)
	}
	return t
}()

// decodeHex decodes s (2·len(dst) hex digits) into dst and reports
// whether every digit was hex. It is hand-written because encoding/hex
// decodes only from []byte: converting each of a chain's thousands of
// strings would allocate once per hash.
func decodeHex(dst []byte, s string) bool {
	bad := byte(0)
	for i := range dst {
		hi, lo := hexValue[s[2*i]], hexValue[s[2*i+1]]
		bad |= hi | lo
		dst[i] = hi<<4 | lo
	}
	return bad&0xf0 == 0
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
