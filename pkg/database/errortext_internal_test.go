package database

import (
	"errors"
	"strings"
	"testing"

	"github.com/kvmesh/kvmesh/pkg/text"
)

func TestErrorTextIsBoundedAndStorable(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name, in, want string
	}{
		{"as is", "broker down", "broker down"},
		{"nul", "a\x00b", "a\uFFFDb"},
		{"invalid", "a\xffb", "a\uFFFDb"},
		{"cut", strings.Repeat("x", maxErrorText+5), strings.Repeat("x", maxErrorText)},
		{"cut inside a rune", strings.Repeat("x", maxErrorText-1) + "é", strings.Repeat("x", maxErrorText-1)},
	}
	for _, tt := range tests {
		got := errorText(errors.New(tt.in))
		if got != tt.want || !text.PostgresSafe(got) || len(got) > maxErrorText {
			t.Errorf("%s: errorText = %q, want %q", tt.name, got, tt.want)
		}
	}
}

func TestOwnCommit(t *testing.T) {
	for _, tc := range []struct {
		self, payload string
		want          bool
	}{
		{"kvmesh-sender", "kvmesh-sender", true},
		{"kvmesh-sender", "kvmesh-scheduler", false},
		{"kvmesh-sender", "", true}, // an unnamed session, or the trigger before 0012
		{"", "kvmesh-scheduler", true},
		{"", "", true},
	} {
		if got := ownCommit(tc.self, tc.payload); got != tc.want {
			t.Errorf("ownCommit(%q, %q) = %v, want %v", tc.self, tc.payload, got, tc.want)
		}
	}
}
