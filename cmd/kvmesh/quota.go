package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/url"
	"strconv"
	"strings"

	"github.com/dustin/go-humanize"

	"github.com/kvmesh/kvmesh/pkg/adminapi"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

func init() {
	register("quota", "list, show, set and remove the tenants' quotas in the store (quota list|get|set|delete; the sender's /v1/quotas)", runQuota)
}

// quotasPath is the sender's collection of tenant quotas.
const quotasPath = "/v1/quotas"

// runQuota dispatches quota list, get, set and delete.
func runQuota(ctx context.Context, args []string) error {
	sub := map[string]func(context.Context, []string) error{
		"list": quotaList, "get": quotaGet, "set": quotaSet, "delete": quotaDelete,
	}
	if len(args) == 0 || sub[args[0]] == nil {
		fmt.Fprintln(stderr, "usage: kvmesh quota list\n"+
			"       kvmesh quota get TENANT\n"+
			"       kvmesh quota set TENANT [--max-bytes N] [--max-keys N] [--on-full evict|skip]\n"+
			"       kvmesh quota delete TENANT\n"+
			"Each takes the shared flags; run 'kvmesh quota set -h' for them.")
		return fmt.Errorf("%w: quota needs list, get, set or delete", errUsage)
	}
	return sub[args[0]](ctx, args[1:])
}

func quotaList(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("quota list", flag.ContinueOnError)
	fs.SetOutput(stderr)
	o := addClientFlags(fs)
	if rest, err := parseFlags(fs, args); err != nil || len(rest) > 0 {
		return usageOr(err, "quota list takes no arguments: %q", rest)
	}
	c := newClient(o)
	defer c.close()
	var q adminapi.Quotas
	raw, err := c.getJSON(ctx, o.sender, quotasPath, nil, &q)
	if err != nil {
		return err
	}
	if o.json {
		return writeJSON(stdout, raw)
	}
	return quotaTable(stdout, q.Items)
}

func quotaGet(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("quota get", flag.ContinueOnError)
	fs.SetOutput(stderr)
	o := addClientFlags(fs)
	tenant, err := tenantArg(fs, args, "quota get")
	if err != nil {
		return err
	}
	c := newClient(o)
	defer c.close()
	var s adminapi.QuotaStatus
	raw, err := c.getJSON(ctx, o.sender, quotaPath(tenant), nil, &s)
	if err != nil {
		return err
	}
	if o.json {
		return writeJSON(stdout, raw)
	}
	return quotaTable(stdout, []adminapi.QuotaStatus{s})
}

func quotaSet(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("quota set", flag.ContinueOnError)
	fs.SetOutput(stderr)
	o := addClientFlags(fs)
	var maxBytes byteSize
	fs.Var(&maxBytes, "max-bytes", "bound of the tenant's bytes in the store: bytes, or a size such as 512MiB, 2GiB or 1.5GB (0 or not given: unlimited)")
	maxKeys := fs.Int64("max-keys", 0, "bound of the tenant's keys in the store (0 or not given: unlimited)")
	onFull := fs.String("on-full", adminapi.QuotaEvict, "what a save past the quota does: evict (the tenant's own least recently used blocks) or skip (the save's blocks that do not fit)")
	tenant, err := tenantArg(fs, args, "quota set")
	if err != nil {
		return err
	}
	q := adminapi.TenantQuota{Tenant: tenant, MaxBytes: int64(maxBytes), MaxKeys: *maxKeys, OnFull: *onFull}
	switch {
	case q.MaxKeys < 0:
		return fmt.Errorf("%w: --max-keys %d is negative (0: unlimited)", errUsage, q.MaxKeys)
	case q.MaxBytes == 0 && q.MaxKeys == 0:
		return fmt.Errorf("%w: quota set needs --max-bytes or --max-keys (or both): a quota without a bound bounds nothing (kvmesh quota delete removes one)", errUsage)
	case q.OnFull != adminapi.QuotaEvict && q.OnFull != adminapi.QuotaSkip:
		return fmt.Errorf("%w: --on-full %q is neither %s nor %s", errUsage, q.OnFull, adminapi.QuotaEvict, adminapi.QuotaSkip)
	}
	c := newClient(o)
	defer c.close()
	var stored adminapi.TenantQuota
	raw, err := c.putJSON(ctx, o.sender, quotaPath(tenant), q, &stored)
	if err != nil {
		return err
	}
	if o.json {
		return writeJSON(stdout, raw)
	}
	tw := newTable(stdout, "TENANT", "QUOTA BYTES", "QUOTA KEYS", "ON FULL", "UPDATED")
	row(tw, stored.Tenant, bytesBound(stored.MaxBytes), keysBound(stored.MaxKeys), stored.OnFull, formatTime(stored.UpdatedAt))
	return tw.Flush()
}

func quotaDelete(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("quota delete", flag.ContinueOnError)
	fs.SetOutput(stderr)
	o := addClientFlags(fs)
	tenant, err := tenantArg(fs, args, "quota delete")
	if err != nil {
		return err
	}
	c := newClient(o)
	defer c.close()
	if _, err := c.do(ctx, o.sender, http.MethodDelete, quotaPath(tenant), nil, true); err != nil {
		return err
	}
	if !o.json { // the sender answers 204 No Content: no JSON to print
		fmt.Fprintf(stdout, "quota of tenant %q removed\n", tenant)
	}
	return nil
}

// tenantArg parses the flags and the one TENANT argument of cmd; a missing
// or invalid tenant is a usage error.
func tenantArg(fs *flag.FlagSet, args []string, cmd string) (string, error) {
	rest, err := parseFlags(fs, args)
	if err != nil || len(rest) != 1 {
		return "", usageOr(err, "%s takes one TENANT, got %q", cmd, rest)
	}
	if rest[0] == "" {
		return "", fmt.Errorf("%w: %s: a quota is per tenant; the tenant-less key space has none", errUsage, cmd)
	}
	if err := kvcore.ValidateTenant(rest[0]); err != nil {
		return "", fmt.Errorf("%w: %s: %w", errUsage, cmd, err)
	}
	return rest[0], nil
}

// quotaPath is the sender's route of one tenant's quota.
func quotaPath(tenant string) string { return quotasPath + "/" + url.PathEscape(tenant) }

// quotaTable prints quotas with their usage: human sizes, and the share of
// each bound used.
func quotaTable(w io.Writer, items []adminapi.QuotaStatus) error {
	tw := newTable(w, "TENANT", "QUOTA BYTES", "USED BYTES", "QUOTA KEYS", "USED KEYS", "ON FULL", "EVICTED", "SKIPPED", "UPDATED")
	for _, s := range items {
		row(tw, s.Tenant,
			bytesBound(s.MaxBytes), withShare(humanize.IBytes(nonNegative(s.UsageBytes)), s.UsageBytes, s.MaxBytes),
			keysBound(s.MaxKeys), withShare(strconv.FormatInt(s.UsageKeys, 10), s.UsageKeys, s.MaxKeys),
			orDash(s.OnFull), s.EvictedBlocks, s.SkippedBlocks, formatTime(s.UpdatedAt))
	}
	return tw.Flush()
}

// unlimited is how a table shows a bound of 0.
const unlimited = "unlimited"

// bytesBound prints a bytes bound as a human size, or unlimited.
func bytesBound(n int64) string {
	if n <= 0 {
		return unlimited
	}
	return humanize.IBytes(uint64(n))
}

// keysBound prints a keys bound, or unlimited.
func keysBound(n int64) string {
	if n <= 0 {
		return unlimited
	}
	return strconv.FormatInt(n, 10)
}

// withShare appends to text the share of bound that used is, "(25.0%)";
// text alone when there is no bound.
func withShare(text string, used, bound int64) string {
	if bound <= 0 {
		return text
	}
	return fmt.Sprintf("%s (%.1f%%)", text, float64(used)*100/float64(bound))
}

// nonNegative is n as a uint64, 0 for a negative n.
func nonNegative(n int64) uint64 { return uint64(max(n, 0)) }

// byteSize is a flag of a size in bytes: plain bytes or a human size
// (512MiB, 2 GiB, 1.5GB), read by go-humanize's ParseBytes (KiB, MiB, …
// are powers of 1024; kB, MB, … powers of 1000).
type byteSize int64

// String prints the size in bytes.
func (b *byteSize) String() string {
	if b == nil {
		return "0"
	}
	return strconv.FormatInt(int64(*b), 10)
}

// Set parses a size; one past math.MaxInt64 bytes is refused.
func (b *byteSize) Set(s string) error {
	n, err := humanize.ParseBytes(strings.TrimSpace(s))
	if err != nil {
		return fmt.Errorf("%q is not a size in bytes (such as 536870912, 512MiB, 2GiB or 1.5GB): %w", s, err)
	}
	if n > math.MaxInt64 {
		return fmt.Errorf("%q is over the largest size, %d bytes", s, int64(math.MaxInt64))
	}
	*b = byteSize(n)
	return nil
}

// putJSON PUTs body as JSON to path on ep as the operator and decodes the
// answer into out; it returns the raw answer too.
func (c *client) putJSON(ctx context.Context, ep endpoint, path string, body, out any) ([]byte, error) {
	payload, err := json.Marshal(body)
	if err != nil {
		return nil, fmt.Errorf("encode the body of PUT %s: %w", path, err)
	}
	answer, err := c.send(ctx, ep, http.MethodPut, path, nil, true, payload)
	if err != nil {
		return nil, err
	}
	if err := json.Unmarshal(answer, out); err != nil {
		return nil, fmt.Errorf("%s at %s: %s answered something that is not the expected JSON: %w", ep.name, ep.url, path, err)
	}
	return answer, nil
}
