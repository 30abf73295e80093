package main

import (
	"bytes"
	"encoding/json"
	"flag"
	"io"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/internal/testenv/meshtest"
	"github.com/kvmesh/kvmesh/pkg/adminapi"
)

// TestQuotaCommand runs kvmesh quota against a real sender (a subprocess
// on a fresh database kvmesh migrate migrated): set, get, list and delete, the tables
// and --json (the sender's answer, decoded into the adminapi types), a set
// replacing a quota, and the sender's refusals. The steps run in order and
// build on each other.
func TestQuotaCommand(t *testing.T) {
	t.Setenv("KVMESH_ADMIN_TOKEN", "") // the steps pass --token explicitly
	m := meshtest.New(t, "cliquota", "KVMESH_MODEL=hybrid-mla-linear", "KVMESH_KAFKA_PARTITIONS=2",
		"KVMESH_LOG_LEVEL=info", "KVMESH_SHUTDOWN_TIMEOUT=3s")
	if err := migrateDatabase(t.Context(), []string{"--database-url", m.DatabaseURL}, io.Discard); err != nil {
		t.Fatalf("kvmesh migrate: %v", err)
	}
	p, err := m.Start("sender", "sender")
	if err != nil {
		t.Fatal(err)
	}
	tokenless := []string{"--sender-url", p.URL(), "--timeout", "20s"}
	flags := slices.Concat(tokenless, []string{"--token", m.AdminToken})

	acme := adminapi.TenantQuota{Tenant: "acme", MaxBytes: 512 << 20, MaxKeys: 1000, OnFull: adminapi.QuotaEvict}
	beta := adminapi.TenantQuota{Tenant: "beta", MaxKeys: 10, OnFull: adminapi.QuotaSkip}
	acme2 := adminapi.TenantQuota{Tenant: "acme", MaxBytes: 1_500_000_000, OnFull: adminapi.QuotaEvict}
	steps := []struct {
		name   string
		args   []string
		token  bool
		code   int
		rows   [][]string // the table's rows, when not nil
		json   any        // what --json must decode to (UpdatedAt zeroed), when not nil
		stderr string
	}{
		{name: "list none", args: []string{"quota", "list"}, token: true, rows: [][]string{}},
		{name: "set bytes and keys", args: []string{"quota", "set", "acme", "--max-bytes", "512MiB", "--max-keys", "1000"}, token: true,
			rows: [][]string{{"acme", "512", "MiB", "1000", "evict"}}},
		{name: "set keys, skip, json", args: []string{"quota", "set", "--max-keys", "10", "--on-full", "skip", "beta", "--json"}, token: true,
			json: beta},
		{name: "get", args: []string{"quota", "get", "acme"}, token: true,
			rows: [][]string{{"acme", "512", "MiB", "0", "B", "(0.0%)", "1000", "0", "(0.0%)", "evict", "0", "0"}}},
		{name: "get json", args: []string{"quota", "get", "acme", "--json"}, token: true,
			json: adminapi.QuotaStatus{TenantQuota: acme}},
		{name: "list json", args: []string{"quota", "list", "--json"}, token: true,
			json: adminapi.Quotas{Items: []adminapi.QuotaStatus{{TenantQuota: acme}, {TenantQuota: beta}}}},
		{name: "set replaces", args: []string{"quota", "set", "acme", "--max-bytes", "1.5GB", "--json"}, token: true,
			json: acme2},
		{name: "list", args: []string{"quota", "list"}, token: true, rows: [][]string{
			{"acme", "1.4", "GiB", "0", "B", "(0.0%)", "unlimited", "0", "evict", "0", "0"},
			{"beta", "unlimited", "0", "B", "10", "0", "(0.0%)", "skip", "0", "0"},
		}},
		{name: "delete", args: []string{"quota", "delete", "beta"}, token: true},
		{name: "get deleted", args: []string{"quota", "get", "beta"}, token: true, code: 1, stderr: "no quota for the tenant"},
		{name: "delete deleted", args: []string{"quota", "delete", "beta"}, token: true, code: 1, stderr: "no quota for the tenant"},
		{name: "no token", args: []string{"quota", "list"}, code: 1, stderr: "pass --token"},
		{name: "set without a token", args: []string{"quota", "set", "acme", "--max-keys", "1"}, code: 1, stderr: "pass --token"},
		{name: "list after", args: []string{"quota", "list"}, token: true, rows: [][]string{
			{"acme", "1.4", "GiB", "0", "B", "(0.0%)", "unlimited", "0", "evict", "0", "0"},
		}},
	}
	for _, s := range steps {
		args := slices.Concat(s.args, tokenless)
		if s.token {
			args = slices.Concat(s.args, flags)
		}
		r := runCLI(t, args...)
		if r.code != s.code {
			t.Fatalf("%s: exit %d, want %d; stderr:\n%s", s.name, r.code, s.code, r.stderr)
		}
		if !strings.Contains(r.stderr, s.stderr) {
			t.Errorf("%s: stderr %q lacks %q", s.name, r.stderr, s.stderr)
		}
		if s.rows != nil {
			checkQuotaRows(t, s.name, r, s.rows)
		}
		if s.json != nil {
			got := reflect.New(reflect.TypeOf(s.json))
			if err := json.Unmarshal([]byte(r.stdout), got.Interface()); err != nil {
				t.Fatalf("%s: stdout is not the JSON of a %T: %v", s.name, s.json, err)
			}
			if v := zeroUpdatedAt(t, s.name, got.Elem().Interface()); !reflect.DeepEqual(v, s.json) {
				t.Errorf("%s: --json %+v, want %+v", s.name, v, s.json)
			}
		}
	}
}

// checkQuotaRows compares a quota table's rows but for their last field, the
// time of the update, which it checks is recent.
func checkQuotaRows(t *testing.T, step string, r cliRun, want [][]string) {
	t.Helper()
	got := r.rows()
	if len(got) != len(want) {
		t.Fatalf("%s: %d rows, want %d:\n%s", step, len(got), len(want), r.stdout)
	}
	for i, row := range got {
		n := len(row) - 2 // the UPDATED column is a date and a time
		if n < 0 || !reflect.DeepEqual(row[:n], want[i]) {
			t.Errorf("%s: row %q, want %q and the update's time", step, row, want[i])
			continue
		}
		at, err := time.Parse(time.DateTime, row[n]+" "+row[n+1])
		if err != nil || time.Since(at) > time.Hour || time.Until(at) > time.Minute {
			t.Errorf("%s: row %q: updated %q, want a time of the last minutes (%v)", step, row, row[n:], err)
		}
	}
}

// zeroUpdatedAt returns v, one of the quota answers, with every UpdatedAt
// zeroed after checking it is set.
func zeroUpdatedAt(t *testing.T, step string, v any) any {
	t.Helper()
	check := func(q *adminapi.TenantQuota) {
		if q.UpdatedAt.IsZero() {
			t.Errorf("%s: tenant %q has no updated_at", step, q.Tenant)
		}
		q.UpdatedAt = time.Time{}
	}
	switch v := v.(type) {
	case adminapi.TenantQuota:
		check(&v)
		return v
	case adminapi.QuotaStatus:
		check(&v.TenantQuota)
		return v
	case adminapi.Quotas:
		for i := range v.Items {
			check(&v.Items[i].TenantQuota)
		}
		return v
	}
	t.Fatalf("%s: %T is no quota answer", step, v)
	return nil
}

// TestQuotaTable checks the table of quotas: human sizes, unlimited for a
// bound of 0, and the share of each bound in use (over 100% too).
func TestQuotaTable(t *testing.T) {
	at := time.Date(2026, 12, 5, 10, 0, 0, 0, time.UTC)
	tests := []struct {
		name string
		s    adminapi.QuotaStatus
		want string // the row
	}{
		{"both bounds",
			adminapi.QuotaStatus{TenantQuota: adminapi.TenantQuota{Tenant: "acme", MaxBytes: 512 << 20, MaxKeys: 1000, OnFull: "evict", UpdatedAt: at},
				UsageBytes: 128 << 20, UsageKeys: 250, EvictedBlocks: 3, SkippedBlocks: 0},
			"acme 512 MiB 128 MiB (25.0%) 1000 250 (25.0%) evict 3 0 2026-12-05 10:00:00"},
		{"keys only, over the quota",
			adminapi.QuotaStatus{TenantQuota: adminapi.TenantQuota{Tenant: "beta", MaxKeys: 8, OnFull: "skip", UpdatedAt: at},
				UsageBytes: 3 << 30, UsageKeys: 9, SkippedBlocks: 12},
			"beta unlimited 3.0 GiB 8 9 (112.5%) skip 0 12 2026-12-05 10:00:00"},
		{"bytes only, empty",
			adminapi.QuotaStatus{TenantQuota: adminapi.TenantQuota{Tenant: "c.d-e_f", MaxBytes: 1_500_000_000}},
			"c.d-e_f 1.4 GiB 0 B (0.0%) unlimited 0 - 0 0 -"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var buf bytes.Buffer
			if err := quotaTable(&buf, []adminapi.QuotaStatus{tt.s}); err != nil {
				t.Fatal(err)
			}
			lines := strings.Split(strings.TrimRight(buf.String(), "\n"), "\n")
			if len(lines) != 2 || !strings.HasPrefix(lines[0], "TENANT") {
				t.Fatalf("table %q: want a header and one row", buf.String())
			}
			if got := strings.Join(strings.Fields(lines[1]), " "); got != tt.want {
				t.Errorf("row %q, want %q", got, tt.want)
			}
		})
	}
}

// TestQuotaByteSize checks --max-bytes: plain bytes, binary and decimal
// sizes, and the values it refuses.
func TestQuotaByteSize(t *testing.T) {
	tests := []struct {
		in   string
		want int64
		err  bool
	}{
		{in: "536870912", want: 512 << 20},
		{in: "512MiB", want: 512 << 20},
		{in: "2GiB", want: 2 << 30},
		{in: "2 GiB", want: 2 << 30},
		{in: "1.5GB", want: 1_500_000_000},
		{in: "64kb", want: 64_000},
		{in: "1,000", want: 1000},
		{in: "0", want: 0},
		{in: "", err: true},
		{in: "-1", err: true},
		{in: "lots", err: true},
		{in: "12XB", err: true},
		{in: "8EiB", err: true}, // 2^63: past the largest int64
	}
	for _, tt := range tests {
		var b byteSize
		err := b.Set(tt.in)
		switch {
		case tt.err && err == nil:
			t.Errorf("Set(%q) = %d, want an error", tt.in, b)
		case !tt.err && err != nil:
			t.Errorf("Set(%q): %v", tt.in, err)
		case !tt.err && int64(b) != tt.want:
			t.Errorf("Set(%q) = %d, want %d", tt.in, b, tt.want)
		}
	}
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	var b byteSize
	fs.Var(&b, "max-bytes", "")
	if err := fs.Parse([]string{"--max-bytes", "lots"}); err == nil || !strings.Contains(err.Error(), "512MiB") {
		t.Errorf("a bad --max-bytes: %v, want an error giving examples", err)
	}
}

// TestQuotaUsageErrors checks the command lines kvmesh quota refuses
// before asking the sender: exit 2 with the reason.
func TestQuotaUsageErrors(t *testing.T) {
	// A sender that is not there: a command line that reached it would exit 1.
	flags := []string{"--sender-url", "http://127.0.0.1:1", "--token", "t"}
	tests := []struct {
		args []string
		want string
	}{
		{[]string{"quota"}, "quota needs list, get, set or delete"},
		{[]string{"quota", "show"}, "quota needs list, get, set or delete"},
		{[]string{"quota", "list", "acme"}, "takes no arguments"},
		{[]string{"quota", "get"}, "takes one TENANT"},
		{[]string{"quota", "get", "a", "b"}, "takes one TENANT"},
		{[]string{"quota", "get", "no spaces"}, "is not one of"},
		{[]string{"quota", "delete", ""}, "the tenant-less key space has none"},
		{[]string{"quota", "set", "acme"}, "needs --max-bytes or --max-keys"},
		{[]string{"quota", "set", "acme", "--max-bytes", "0", "--max-keys", "0"}, "needs --max-bytes or --max-keys"},
		{[]string{"quota", "set", "acme", "--max-bytes", "lots"}, "not a size in bytes"},
		{[]string{"quota", "set", "acme", "--max-keys", "-1"}, "--max-keys -1 is negative"},
		{[]string{"quota", "set", "acme", "--max-keys", "5", "--on-full", "drop"}, `--on-full "drop" is neither evict nor skip`},
		{[]string{"quota", "set", "acme", "--max-keys", "5", "--nope"}, "flag provided but not defined"},
	}
	for _, tt := range tests {
		t.Run(strings.Join(tt.args, " "), func(t *testing.T) {
			r := runCLI(t, slices.Concat(tt.args, flags)...)
			if r.code != 2 || !strings.Contains(r.stderr, tt.want) {
				t.Errorf("exit %d, stderr %q; want exit 2 saying %q", r.code, r.stderr, tt.want)
			}
		})
	}
}
