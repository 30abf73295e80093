package deploy

import (
	"fmt"
	"strings"
)

// Interpolate replaces compose variables in s: $$ is a literal $, and
// ${VAR}, $VAR, ${VAR:-default} (default when unset or empty),
// ${VAR-default} (default when unset), ${VAR:?message} and ${VAR?message}
// (an error when unset or empty / unset) take their values from lookup.
// Defaults are themselves interpolated.
func Interpolate(s string, lookup func(string) (string, bool)) (string, error) {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] != '$' || i+1 == len(s) {
			b.WriteByte(s[i])
			continue
		}
		switch next := s[i+1]; {
		case next == '$':
			b.WriteByte('$')
			i++
		case next == '{':
			end := closingBrace(s, i+2)
			if end < 0 {
				return "", fmt.Errorf("%w: unclosed ${ in %q", ErrSyntax, s)
			}
			v, err := expand(s[i+2:end], lookup)
			if err != nil {
				return "", err
			}
			b.WriteString(v)
			i = end
		case isNameByte(next, true):
			j := i + 1
			for j < len(s) && isNameByte(s[j], false) {
				j++
			}
			v, _ := lookup(s[i+1 : j])
			b.WriteString(v)
			i = j - 1
		default:
			b.WriteByte('$')
		}
	}
	return b.String(), nil
}

// closingBrace returns the index of the } that closes the ${ whose body
// starts at from, allowing nested ${...} in defaults; -1 when none does.
func closingBrace(s string, from int) int {
	depth := 1
	for i := from; i < len(s); i++ {
		switch s[i] {
		case '{':
			depth++
		case '}':
			depth--
			if depth == 0 {
				return i
			}
		}
	}
	return -1
}

// expand resolves the body of one ${...}.
func expand(body string, lookup func(string) (string, bool)) (string, error) {
	name := body
	op, arg := "", ""
	if i := strings.IndexAny(body, ":-?"); i >= 0 {
		name, op, arg = body[:i], body[i:i+1], body[i+1:]
		if op == ":" && arg != "" {
			op, arg = op+arg[:1], arg[1:]
		}
	}
	if name == "" {
		return "", fmt.Errorf("%w: ${%s} names no variable", ErrSyntax, body)
	}
	v, set := lookup(name)
	switch op {
	case "":
		return v, nil
	case ":-", "-":
		if (op == ":-" && v == "") || !set {
			return Interpolate(arg, lookup)
		}
		return v, nil
	case ":?", "?":
		if (op == ":?" && v == "") || !set {
			return "", fmt.Errorf("%w: %s: %s", ErrInterpolation, name, arg)
		}
		return v, nil
	}
	return "", fmt.Errorf("%w: ${%s}", ErrSyntax, body)
}

// isNameByte reports whether c may appear in a variable name (first: as
// its first byte).
func isNameByte(c byte, first bool) bool {
	return c == '_' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || !first && c >= '0' && c <= '9'
}
