package kvcore

import "fmt"

// MaxTenantBytes bounds a tenant's length.
const MaxTenantBytes = 64

// tagTenant introduces the tenant segment of a store key. No other segment
// of a key starts with it: the rank and group segments have tags of their
// own, and a model name may not start with it (KeyBuilder.Validate).
const tagTenant = "@tenant:"

// ValidateTenant reports a tenant that cannot be a key segment. The empty
// tenant (no tenant: the keys vLLM writes) is valid; any other tenant is 1
// to MaxTenantBytes bytes of [A-Za-z0-9._-]. The error wraps ErrBadTenant.
//
// A tenant plays the role of vLLM's per-request cache_salt: requests of two
// tenants never share a store key, even when their block hashes are equal.
func ValidateTenant(t string) error {
	if len(t) > MaxTenantBytes {
		return fmt.Errorf("tenant of %d bytes, at most %d allowed: %w", len(t), MaxTenantBytes, ErrBadTenant)
	}
	for i := 0; i < len(t); i++ {
		if !tenantByte(t[i]) {
			return fmt.Errorf("tenant %q: byte %d (%q) is not one of [A-Za-z0-9._-]: %w", t, i, t[i], ErrBadTenant)
		}
	}
	return nil
}

// tenantByte reports whether c may appear in a tenant.
func tenantByte(c byte) bool {
	switch {
	case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9':
		return true
	}
	return c == '.' || c == '_' || c == '-'
}

// WithPrefix returns kb with its deployment prefix set to p. The prefix is
// not checked here; Validate does.
func (kb KeyBuilder) WithPrefix(p string) KeyBuilder {
	kb.Prefix = p
	return kb
}

// ForTenant returns kb with its tenant set to t: the builder of t's own
// key space. The tenant is not checked here; Validate (or ValidateTenant)
// does, and the planners refuse a bad one.
func (kb KeyBuilder) ForTenant(t string) KeyBuilder {
	kb.Tenant = t
	return kb
}
