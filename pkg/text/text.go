// Package text holds kvmesh's two rules for strings it keeps or sends:
// Truncate bounds a string's length without splitting a UTF-8 sequence, and
// ForPostgres makes a string storable in a PostgreSQL text column (which
// refuses NUL characters and invalid UTF-8), with PostgresSafe the test for
// a string it would leave unchanged.
package text

import (
	"strings"
	"unicode/utf8"
)

// Replacement is what ForPostgres puts in place of a NUL character or a
// run of invalid UTF-8: U+FFFD.
const Replacement = "\uFFFD"

// Truncate shortens s to at most n bytes without splitting a UTF-8
// sequence: a string over n bytes is cut to its first n bytes, and any
// invalid UTF-8 in them (a sequence the cut split included) is dropped. A
// string of at most n bytes is returned as it is.
func Truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return strings.ToValidUTF8(s[:max(n, 0)], "")
}

// ForPostgres makes s storable in a PostgreSQL text column: NUL characters
// and each run of invalid UTF-8 become U+FFFD. A string PostgresSafe
// accepts is returned as it is.
func ForPostgres(s string) string {
	if PostgresSafe(s) {
		return s
	}
	return strings.ReplaceAll(strings.ToValidUTF8(s, Replacement), "\x00", Replacement)
}

// PostgresSafe reports whether s is stored unchanged by ForPostgres: valid
// UTF-8 without NUL characters.
func PostgresSafe(s string) bool { return utf8.ValidString(s) && !strings.ContainsRune(s, 0) }
