package kvcore

import "strings"

// SplitKey splits a store key at its last '@' into its namespace (the part
// every key of one rank and group shares, KeyBuilder.Namespace) and the hex
// block hash after it. ok is false when key has no '@' or an empty part.
func SplitKey(key string) (namespace, hashHex string, ok bool) {
	i := strings.LastIndexByte(key, keySep)
	if i <= 0 || i == len(key)-1 {
		return "", "", false
	}
	return key[:i], key[i+1:], true
}

// ParseOwn is the inverse of kb.Key for the keys of kb's own key space: it
// takes key apart with ParseKey and reports whether it carries kb's prefix,
// model name and fingerprint. A deployment's key space holds every
// tenant's keys, so the key's tenant (KeyParts.Tenant) is not compared
// with kb's. A malformed key returns ParseKey's error (wrapping ErrBadKey);
// a well-formed key of another deployment, model or layout (fingerprint)
// returns ok false and no error, since a store pool may be shared.
func (kb KeyBuilder) ParseOwn(key string) (p KeyParts, ok bool, err error) {
	p, err = ParseKey(key)
	if err != nil {
		return KeyParts{}, false, err
	}
	return p, kb.owns(p), nil
}

// owns reports whether the parsed key p is of kb's deployment, model and
// layout.
func (kb KeyBuilder) owns(p KeyParts) bool {
	return p.Prefix == kb.Prefix && p.Model == kb.Model && p.Fingerprint == kb.Fingerprint
}
