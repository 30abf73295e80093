package kvcore

import (
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"strconv"
	"strings"
)

// Store keys follow Mooncake's layout, with the model's compatibility
// fingerprint after the model name:
//
//	[{prefix}@]{model}@fp:{fingerprint}[@tenant:{t}]@tp_rank:{r}@pcp{p}@dcp{d}@pp_rank:{pp}@group:{g}@{block_hash_hex}
//
// The fingerprint (Model.Fingerprint) digests everything that decides a
// block's bytes (KV dtype, layout version, engine version, block sizes,
// parallel layout), so a block written under another layout is another
// key: a miss, never a wrong load. The tenant segment is written only for
// a non-empty tenant. Everything before the last '@' is the key's
// namespace: one per (fingerprint, tenant, rank, group).
const (
	keySep     = '@'
	tagTP      = "@tp_rank:"
	tagPCP     = "@pcp"
	tagDCP     = "@dcp"
	tagPP      = "@pp_rank:"
	tagGroup   = "@group:"
	tagFP      = "@fp:"
	keyFields  = 7 // model, tp, pcp, dcp, pp, group, hash (prefix, fingerprint and tenant optional)
	rankFields = 6 // tp, pcp, dcp, pp, group, hash: the fixed tail of every key
	maxIntText = 20
)

// KeyBuilder builds the store keys of one model under an optional deployment
// prefix and an optional tenant. The zero Prefix means no prefix segment;
// the zero Tenant no tenant segment.
type KeyBuilder struct {
	// Prefix separates deployments sharing one store; it may not contain '@'.
	Prefix string
	// Model is the model name (Model.Name).
	Model string
	// Fingerprint is the model's compatibility fingerprint
	// (Model.Fingerprint), written after the model name. A service's
	// builder always has one (NewKeyBuilder); empty writes no segment,
	// which only unit tests of the key layout use.
	Fingerprint string
	// Tenant separates the key spaces of tenants of one deployment
	// (ValidateTenant): two tenants never share a key, even for equal
	// block hashes. A service's builder has none; each task's keys are
	// built with the task's tenant (ForTenant).
	Tenant string
}

// NewKeyBuilder returns the validated KeyBuilder of model m's keys under
// prefix: m's name and fingerprint.
func NewKeyBuilder(prefix string, m *Model) (KeyBuilder, error) {
	kb := KeysOf(m)
	kb.Prefix = prefix
	if err := kb.Validate(); err != nil {
		return KeyBuilder{}, err
	}
	return kb, nil
}

// KeysOf is the KeyBuilder of model m's keys without a prefix or tenant.
func KeysOf(m *Model) KeyBuilder {
	return KeyBuilder{Model: m.Name, Fingerprint: m.Fingerprint()}
}

// Validate reports a prefix or model name that would make keys ambiguous:
// neither may contain '@' or whitespace, the model name may not be empty
// nor start with the tenant tag ("tenant:"), and the tenant must pass
// ValidateTenant (ErrBadTenant).
func (kb KeyBuilder) Validate() error {
	if strings.ContainsAny(kb.Prefix, "@ \t\r\n") {
		return fmt.Errorf("key prefix %q: %w", kb.Prefix, ErrBadKeyPrefix)
	}
	if kb.Model == "" || strings.ContainsAny(kb.Model, "@ \t\r\n") || strings.HasPrefix(kb.Model, tagTenant[1:]) || strings.HasPrefix(kb.Model, tagFP[1:]) {
		return fmt.Errorf("key model name %q: %w", kb.Model, ErrBadKeyPrefix)
	}
	if kb.Fingerprint != "" && !validFingerprint(kb.Fingerprint) {
		return fmt.Errorf("key fingerprint %q (want %d lower-case hex characters): %w", kb.Fingerprint, FingerprintLen, ErrBadKeyPrefix)
	}
	return ValidateTenant(kb.Tenant)
}

// Namespace is the key up to (not including) the '@' before the block hash:
// the part shared by every key of one tenant, rank and group.
func (kb KeyBuilder) Namespace(r Rank, group int) string {
	var sb strings.Builder
	sb.Grow(kb.namespaceLen(r, group))
	kb.writeNamespace(&sb, r, group)
	return sb.String()
}

// Key is the store key of block hash h in group's namespace on rank r.
func (kb KeyBuilder) Key(r Rank, group int, h BlockHash) string {
	var sb strings.Builder
	sb.Grow(kb.namespaceLen(r, group) + 1 + hex.EncodedLen(len(h)))
	kb.writeNamespace(&sb, r, group)
	sb.WriteByte(keySep)
	writeHex(&sb, h)
	return sb.String()
}

// KeyHex is Key for a hash already in hex form, as carried by tasks.
func (kb KeyBuilder) KeyHex(r Rank, group int, hashHex string) string {
	var sb strings.Builder
	sb.Grow(kb.namespaceLen(r, group) + 1 + len(hashHex))
	kb.writeNamespace(&sb, r, group)
	sb.WriteByte(keySep)
	sb.WriteString(hashHex)
	return sb.String()
}

func (kb KeyBuilder) namespaceLen(r Rank, group int) int {
	n := len(kb.Model) + len(tagTP) + len(tagPCP) + len(tagDCP) + len(tagPP) + len(tagGroup) +
		intLen(r.TP) + intLen(r.PCP) + intLen(r.DCP) + intLen(r.PP) + intLen(group)
	if kb.Prefix != "" {
		n += len(kb.Prefix) + 1
	}
	if kb.Fingerprint != "" {
		n += len(tagFP) + len(kb.Fingerprint)
	}
	if kb.Tenant != "" {
		n += len(tagTenant) + len(kb.Tenant)
	}
	return n
}

func (kb KeyBuilder) writeNamespace(sb *strings.Builder, r Rank, group int) {
	if kb.Prefix != "" {
		sb.WriteString(kb.Prefix)
		sb.WriteByte(keySep)
	}
	sb.WriteString(kb.Model)
	if kb.Fingerprint != "" {
		sb.WriteString(tagFP)
		sb.WriteString(kb.Fingerprint)
	}
	if kb.Tenant != "" {
		sb.WriteString(tagTenant)
		sb.WriteString(kb.Tenant)
	}
	writeTagged(sb, tagTP, r.TP)
	writeTagged(sb, tagPCP, r.PCP)
	writeTagged(sb, tagDCP, r.DCP)
	writeTagged(sb, tagPP, r.PP)
	writeTagged(sb, tagGroup, group)
}

func writeTagged(sb *strings.Builder, tag string, v int) {
	var buf [maxIntText]byte
	sb.WriteString(tag)
	sb.Write(strconv.AppendInt(buf[:0], int64(v), 10))
}

// writeHex writes h in lower-case hex through a stack buffer, 64 bytes of
// hash at a time.
func writeHex(sb *strings.Builder, h BlockHash) {
	var buf [128]byte
	for len(h) > 0 {
		n := min(len(h), len(buf)/2)
		encodeHex(buf[:2*n], h[:n])
		sb.Write(buf[:2*n])
		h = h[n:]
	}
}

// hexPairs[b] is byte b's two lower-case hex digits, the first in the low
// byte (the order a little-endian store writes them in).
var hexPairs = func() (t [256]uint16) {
	const digits = "0123456789abcdef"
	for i := range t {
		t[i] = uint16(digits[i>>4]) | uint16(digits[i&0xf])<<8
	}
	return t
}()

// encodeHex writes src in lower-case hex into dst, which holds exactly
// 2·len(src) bytes: one table load and one two-byte store per byte. It is
// hand-written because the lookup plan hex-encodes every hash of a chain
// (thousands per lookup) and encoding/hex.Encode, a digit at a time, runs
// about three times slower; the output is the same.
func encodeHex(dst, src []byte) {
	dst = dst[:2*len(src)]
	for i, b := range src {
		binary.LittleEndian.PutUint16(dst[2*i:], hexPairs[b])
	}
}

// intLen is the length of v in decimal.
func intLen(v int) int {
	n := 1
	if v < 0 {
		n++
		v = -v
	}
	for v >= 10 {
		v /= 10
		n++
	}
	return n
}

// KeyParts is a store key taken apart, for operators and tests.
type KeyParts struct {
	// Prefix is the deployment prefix, empty when the key has none.
	Prefix string
	// Model is the model name.
	Model string
	// Fingerprint is the compatibility fingerprint, empty when the key
	// has no fingerprint segment.
	Fingerprint string
	// Tenant is the tenant, empty when the key has no tenant segment.
	Tenant string
	// Rank is the rank namespace.
	Rank Rank
	// Group is the KV-group index.
	Group int
	// Hash is the block hash.
	Hash BlockHash
}

// Key puts the parts back together.
func (p KeyParts) Key() string {
	return KeyBuilder{Prefix: p.Prefix, Model: p.Model, Fingerprint: p.Fingerprint, Tenant: p.Tenant}.Key(p.Rank, p.Group, p.Hash)
}

// ParseKey takes a store key apart. It accepts exactly the keys KeyBuilder
// writes: seven to ten '@'-separated fields (the prefix, the fingerprint
// segment "fp:{fingerprint}" and the tenant segment "tenant:{t}" after the
// model are optional), canonical decimal numbers, a well-formed
// fingerprint, a valid tenant and a non-empty lower-case hex hash. A model
// name starting with "tenant:" or "fp:" is refused, as KeyBuilder.Validate
// refuses it.
func ParseKey(s string) (KeyParts, error) {
	fields := strings.Split(s, string(keySep))
	if len(fields) < keyFields || len(fields) > keyFields+3 {
		return KeyParts{}, keyError(s, fmt.Sprintf("%d '@'-separated fields, want %d to %d", len(fields), keyFields, keyFields+3))
	}
	var p KeyParts
	head, tail := fields[:len(fields)-rankFields], fields[len(fields)-rankFields:]
	if t, ok := strings.CutPrefix(head[len(head)-1], tagTenant[1:]); ok && len(head) > 1 {
		if t == "" || ValidateTenant(t) != nil {
			return KeyParts{}, keyError(s, fmt.Sprintf("tenant field %q, want %s<tenant> of [A-Za-z0-9._-]", head[len(head)-1], tagTenant[1:]))
		}
		p.Tenant, head = t, head[:len(head)-1]
	}
	if fp, ok := strings.CutPrefix(head[len(head)-1], tagFP[1:]); ok && len(head) > 1 {
		if !validFingerprint(fp) {
			return KeyParts{}, keyError(s, fmt.Sprintf("fingerprint field %q, want %s<%d lower-case hex>", head[len(head)-1], tagFP[1:], FingerprintLen))
		}
		p.Fingerprint, head = fp, head[:len(head)-1]
	}
	switch len(head) {
	case 1:
	case 2:
		p.Prefix, head = head[0], head[1:]
		if p.Prefix == "" {
			return KeyParts{}, keyError(s, "empty prefix")
		}
	default:
		return KeyParts{}, keyError(s, fmt.Sprintf("%d fields before the rank, want [prefix@]model[@fp:...][@tenant:...]", len(head)))
	}
	p.Model = head[0]
	switch {
	case p.Model == "":
		return KeyParts{}, keyError(s, "empty model name")
	case strings.HasPrefix(p.Model, tagTenant[1:]), strings.HasPrefix(p.Model, tagFP[1:]):
		return KeyParts{}, keyError(s, fmt.Sprintf("model name %q starts with a segment tag", p.Model))
	}
	nums := []struct {
		tag string
		dst *int
	}{{tagTP, &p.Rank.TP}, {tagPCP, &p.Rank.PCP}, {tagDCP, &p.Rank.DCP}, {tagPP, &p.Rank.PP}, {tagGroup, &p.Group}}
	for i, n := range nums {
		v, ok := parseTagged(tail[i], n.tag[1:])
		if !ok {
			return KeyParts{}, keyError(s, fmt.Sprintf("field %q, want %s<n>", tail[i], n.tag[1:]))
		}
		*n.dst = v
	}
	hx := tail[rankFields-1]
	h, err := hex.DecodeString(hx)
	if err != nil || len(h) == 0 || hex.EncodeToString(h) != hx {
		return KeyParts{}, keyError(s, fmt.Sprintf("hash %q is not non-empty lower-case hex", hx))
	}
	p.Hash = h
	return p, nil
}

// validFingerprint reports whether fp is FingerprintLen lower-case hex
// characters, as Model.Fingerprint makes them.
func validFingerprint(fp string) bool {
	return len(fp) == FingerprintLen && IsHashHex(fp)
}

// parseTagged reads "<tag><n>" with n a canonical non-negative decimal.
func parseTagged(field, tag string) (int, bool) {
	num, ok := strings.CutPrefix(field, tag)
	if !ok {
		return 0, false
	}
	v, err := strconv.Atoi(num)
	if err != nil || v < 0 || strconv.Itoa(v) != num {
		return 0, false
	}
	return v, true
}

func keyError(key, problem string) error {
	return fmt.Errorf("store key %q: %s: %w", key, problem, ErrBadKey)
}
