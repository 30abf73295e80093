package text_test

import (
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/kvmesh/kvmesh/pkg/text"
)

func TestForPostgres(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name, in, want string
	}{
		{"plain", "ok", "ok"},
		{"empty", "", ""},
		{"multi-byte", "héllo, 世界", "héllo, 世界"},
		{"nul", "a\x00b", "a\uFFFDb"},
		{"nuls", "\x00\x00", "\uFFFD\uFFFD"},
		{"invalid byte", "\xffx", "\uFFFDx"},
		{"run of invalid bytes", "a\xff\xfeb", "a\uFFFDb"},
		{"split sequence at the end", "ab\xe4\xb8", "ab\uFFFD"},
		{"invalid and nul", "\xff\x00", "\uFFFD\uFFFD"},
		{"replacement kept", "\uFFFD", "\uFFFD"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := text.ForPostgres(tt.in)
			if got != tt.want {
				t.Errorf("ForPostgres(%q) = %q, want %q", tt.in, got, tt.want)
			}
			if !text.PostgresSafe(got) {
				t.Errorf("PostgresSafe(ForPostgres(%q)) = false", tt.in)
			}
			if text.PostgresSafe(tt.in) != (tt.in == tt.want) {
				t.Errorf("PostgresSafe(%q) = %v", tt.in, text.PostgresSafe(tt.in))
			}
		})
	}
}

func TestTruncate(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name string
		in   string
		n    int
		want string
	}{
		{"short", "abc", 5, "abc"},
		{"exact", "abc", 3, "abc"},
		{"cut", "abcdef", 3, "abc"},
		{"zero", "abc", 0, ""},
		{"negative", "abc", -1, ""},
		{"no split of a multi-byte rune", "a世界", 2, "a"},
		{"cut after a whole rune", "a世界", 4, "a世"},
		{"invalid kept when not cut", "a\xff", 5, "a\xff"},
		{"invalid dropped when cut", "a\xffbcd", 3, "ab"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := text.Truncate(tt.in, tt.n)
			if got != tt.want {
				t.Errorf("Truncate(%q, %d) = %q, want %q", tt.in, tt.n, got, tt.want)
			}
		})
	}
	long := strings.Repeat("é", 600)
	if got := text.Truncate(long, 1023); len(got) > 1023 || !utf8.ValidString(got) || !strings.HasPrefix(long, got) {
		t.Errorf("Truncate of %d bytes to 1023 = %d bytes, want a valid prefix", len(long), len(got))
	}
}

// TestText is the sender ledger's former table (ledger.Text and
// ledger.Storable), kept as it was.
func TestText(t *testing.T) {
	cases := map[string]string{"ok": "ok", "a\x00b": "a\uFFFDb", "\xffx": "\uFFFDx", "": ""}
	for in, want := range cases {
		if got := text.ForPostgres(in); got != want {
			t.Errorf("ForPostgres(%q) = %q, want %q", in, got, want)
		}
		if text.PostgresSafe(in) != (in == want) {
			t.Errorf("PostgresSafe(%q) = %v", in, text.PostgresSafe(in))
		}
	}
}
