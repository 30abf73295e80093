package deploy

import (
	"errors"
	"fmt"

	"github.com/compose-spec/compose-go/v2/template"
)

// Interpolate replaces compose variables in s as compose does (compose-go's
// template.Substitute): $$ is a literal $, and ${VAR}, $VAR,
// ${VAR:-default} (default when unset or empty), ${VAR-default} (default
// when unset), ${VAR:?message} and ${VAR?message} (an error when unset or
// empty / unset) take their values from lookup. A $ that starts no variable
// is ErrSyntax, as compose refuses it; a required variable unset is
// ErrInterpolation.
func Interpolate(s string, lookup func(string) (string, bool)) (string, error) {
	v, err := template.Substitute(s, lookup)
	if err == nil {
		return v, nil
	}
	var missing *template.MissingRequiredError
	var missingValue template.MissingRequiredError
	if errors.As(err, &missing) || errors.As(err, &missingValue) {
		return "", fmt.Errorf("%w: %w", ErrInterpolation, err)
	}
	return "", fmt.Errorf("%w: %w", ErrSyntax, err)
}

// isNameByte reports whether c may appear in a variable or metric name
// (first: as its first byte).
func isNameByte(c byte, first bool) bool {
	return c == '_' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || !first && c >= '0' && c <= '9'
}
