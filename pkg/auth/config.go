package auth

import (
	"errors"
	"fmt"
)

// Modes of Config.Mode.
const (
	// ModeRequired authenticates every route but the probes, /metrics and
	// the OpenAPI document.
	ModeRequired = "required"
	// ModeOff authenticates nothing new: admin mutations still need the
	// operator token. For development on a trusted host only.
	ModeOff = "off"
	// DefaultMode is KVMESH_AUTH's default (and the mode of a zero Config).
	DefaultMode = ModeRequired
)

// ErrNoKey means authentication is required and no key is configured.
var ErrNoKey = errors.New("auth: KVMESH_AUTH=required (the default) needs KVMESH_AUTH_KEY or KVMESH_AUTH_KEY_FILE; set KVMESH_AUTH=off to run without authentication (development only)")

// Config is the authentication settings every service shares.
type Config struct {
	// Mode is ModeRequired or ModeOff.
	Mode string `env:"KVMESH_AUTH" doc:"required: every route but /healthz, /readyz, /metrics and /openapi.yaml needs a credential (operator, engine or service token); off: none but the admin mutations (development only)"`
	// Key signs and verifies engine and service tokens.
	Key string `env:"KVMESH_AUTH_KEY" secret:"true" doc:"HMAC key (at least 32 bytes) that signs and verifies engine and service tokens; the same in every service (KVMESH_AUTH_KEY_FILE reads it from a file)"`
	// PreviousKey is a key being rotated out: tokens it signed are still
	// accepted, none is signed with it.
	PreviousKey string `env:"KVMESH_AUTH_PREVIOUS_KEY" secret:"true" doc:"during a key rotation, the key being replaced: tokens it signed are still accepted until they expire, new ones are signed with KVMESH_AUTH_KEY; unset once they have"`
}

// SetDefaults gives KVMESH_AUTH's default, DefaultMode
// (config.Defaulter).
func (c *Config) SetDefaults() { c.Mode = DefaultMode }

// mode is the configured mode, DefaultMode when unset.
func (c Config) mode() string {
	if c.Mode == "" {
		return DefaultMode
	}
	return c.Mode
}

// Validate checks the mode, and the key when authentication is required.
func (c Config) Validate() error {
	switch c.mode() {
	case ModeOff:
		return nil
	case ModeRequired:
		if c.Key == "" {
			return ErrNoKey
		}
		if _, err := NewKey(c.Key); err != nil {
			return fmt.Errorf("KVMESH_AUTH_KEY: %w", err)
		}
		if _, err := c.previous(); err != nil {
			return fmt.Errorf("KVMESH_AUTH_PREVIOUS_KEY: %w", err)
		}
		return nil
	default:
		return fmt.Errorf("KVMESH_AUTH: %q is neither %s nor %s", c.Mode, ModeRequired, ModeOff)
	}
}

// Required reports whether routes are authenticated.
func (c Config) Required() bool { return c.mode() != ModeOff }

// Verifier returns the verifier of the configured key and operatorToken,
// or nil when authentication is off.
func (c Config) Verifier(operatorToken string) (*Verifier, error) {
	if !c.Required() {
		return nil, nil
	}
	k, err := NewKey(c.Key)
	if err != nil {
		return nil, err
	}
	prev, err := c.previous()
	if err != nil {
		return nil, err
	}
	return NewVerifier(k, operatorToken, prev...), nil
}

// previous is the key being rotated out, if any.
func (c Config) previous() ([]Key, error) {
	if c.PreviousKey == "" {
		return nil, nil
	}
	k, err := NewKey(c.PreviousKey)
	if err != nil {
		return nil, err
	}
	return []Key{k}, nil
}
