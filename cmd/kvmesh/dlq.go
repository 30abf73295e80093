package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"maps"
	"net/http"
	"net/url"
	"slices"
	"strconv"

	"github.com/kvmesh/kvmesh/pkg/adminapi"
	"github.com/kvmesh/kvmesh/pkg/deadletter"
)

func init() {
	register("dlq", "list, show and replay a service's dead letters (dlq list|show|replay [--service sender|scheduler|gpuworker])", runDLQ)
}

// deadLetter is a dead letter as GET /v1/dlq and /v1/dlq/{id} answer it
// (the same routes in the sender, the scheduler and the gpuworker).
type deadLetter = deadletter.Entry

// groupText prints a dead letter's group, "record" for a whole record.
func groupText(d deadLetter) string {
	if d.Group == nil {
		return "record"
	}
	return strconv.Itoa(*d.Group)
}

// runDLQ dispatches dlq list, show and replay.
func runDLQ(ctx context.Context, args []string) error {
	sub := map[string]func(context.Context, []string) error{"list": dlqList, "show": dlqShow, "replay": dlqReplay}
	if len(args) == 0 || sub[args[0]] == nil {
		fmt.Fprintln(stderr, "usage: kvmesh dlq list [--service S] [--reason R] [--limit N] [--cursor C] [--all]\n"+
			"       kvmesh dlq show [--service S] ID\n"+
			"       kvmesh dlq replay [--service S] ID... | --reason R [--dry-run]\n"+
			"Each takes the shared flags; run 'kvmesh dlq list -h' for them.")
		return fmt.Errorf("%w: dlq needs list, show or replay", errUsage)
	}
	return sub[args[0]](ctx, args[1:])
}

// dlqFilters are the filters of dlq list.
type dlqFilters struct {
	reason, engine, request string
}

func (f dlqFilters) query() url.Values {
	q := url.Values{}
	for k, v := range map[string]string{"reason": f.reason, "engine_id": f.engine, "request_id": f.request} {
		if v != "" {
			q.Set(k, v)
		}
	}
	return q
}

func dlqList(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("dlq list", flag.ContinueOnError)
	fs.SetOutput(stderr)
	o := addClientFlags(fs)
	svc := addDLQServiceFlag(fs)
	p := addPageFlags(fs)
	var f dlqFilters
	fs.StringVar(&f.reason, "reason", "", "only dead letters with this reason code")
	fs.StringVar(&f.engine, "engine", "", "only this engine's dead letters")
	fs.StringVar(&f.request, "request", "", "only this request's dead letters")
	if rest, err := parseFlags(fs, args); err != nil || len(rest) > 0 {
		return usageOr(err, "dlq list takes no arguments: %q", rest)
	}
	ep, err := dlqEndpoint(o, *svc)
	if err != nil {
		return err
	}
	c := newClient(o)
	defer c.close()
	items, raw, next, err := fetchPages[deadLetter](ctx, c, ep, "/v1/dlq", f.query(), p, "dead letters")
	if err != nil {
		return err
	}
	return printPage(o, items, raw, next, dlqTable)
}

// dlqTable prints dead letters as a table.
func dlqTable(w io.Writer, items []deadLetter) error {
	tw := newTable(w, "ID", "TIME", "ENGINE", "REQUEST", "TASK", "GROUP", "REASON", "REPLAY")
	for _, d := range items {
		row(tw, d.ID, formatTime(d.CreatedAt), orDash(d.EngineID), orDash(d.RequestID), orDash(d.TaskID),
			groupText(d), d.Reason, d.ReplayStatus)
	}
	return tw.Flush()
}

func dlqShow(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("dlq show", flag.ContinueOnError)
	fs.SetOutput(stderr)
	o := addClientFlags(fs)
	svc := addDLQServiceFlag(fs)
	rest, err := parseFlags(fs, args)
	if err != nil || len(rest) != 1 {
		return usageOr(err, "dlq show takes one dead-letter id, got %q", rest)
	}
	ep, err := dlqEndpoint(o, *svc)
	if err != nil {
		return err
	}
	c := newClient(o)
	defer c.close()
	var d deadLetter
	raw, err := c.getJSON(ctx, ep, "/v1/dlq/"+url.PathEscape(rest[0]), nil, &d)
	if err != nil {
		return err
	}
	if o.json {
		return writeJSON(stdout, raw)
	}
	return showDeadLetter(stdout, d)
}

// showDeadLetter prints one dead letter, field by field, then its payload.
func showDeadLetter(w io.Writer, d deadLetter) error {
	tw := newTable(w, "FIELD", "VALUE")
	for _, f := range [][2]any{
		{"id", d.ID}, {"reason", d.Reason}, {"detail", d.Detail}, {"group", groupText(d)},
		{"task", orDash(d.TaskID)}, {"engine", orDash(d.EngineID)}, {"request", orDash(d.RequestID)},
		{"record", fmt.Sprintf("%s/%d@%d (%s)", d.Topic, d.Partition, d.Offset, formatTime(d.RecordTime))},
		{"created", formatTime(d.CreatedAt)}, {"replay", fmt.Sprintf("%s (%d attempts)", d.ReplayStatus, d.ReplayCount)},
	} {
		row(tw, f[0], f[1])
	}
	if len(d.ReplayResult) > 0 {
		row(tw, "replay result", string(d.ReplayResult))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if len(d.PayloadJSON) > 0 {
		fmt.Fprintln(w, "payload (JSON):")
		return writeJSON(w, d.PayloadJSON)
	}
	fmt.Fprintf(w, "payload (%d bytes, not JSON): %q\n", len(d.Payload), d.Payload)
	return nil
}

// usageOr returns err, or a usage error built from format and args.
func usageOr(err error, format string, args ...any) error {
	if err != nil {
		return err
	}
	return fmt.Errorf("%w: "+format, append([]any{errUsage}, args...)...)
}

// replayOutcome is what happened to one entry of a replay run.
type replayOutcome struct {
	ID      int64           `json:"id"`
	Reason  string          `json:"reason,omitempty"`
	Outcome string          `json:"outcome"`
	Detail  string          `json:"detail,omitempty"`
	Failed  bool            `json:"failed"`
	Answer  json.RawMessage `json:"answer,omitempty"`
}

func dlqReplay(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("dlq replay", flag.ContinueOnError)
	fs.SetOutput(stderr)
	o := addClientFlags(fs)
	svc := addDLQServiceFlag(fs)
	var reason string
	var dry bool
	fs.StringVar(&reason, "reason", "", "replay every dead letter with this reason code (all pages)")
	fs.BoolVar(&dry, "dry-run", false, "only say what each replay would do; nothing is saved or recorded")
	rest, err := parseFlags(fs, args)
	if err != nil || (len(rest) == 0) == (reason == "") {
		return usageOr(err, "dlq replay takes dead-letter ids or --reason, not both")
	}
	ep, err := dlqEndpoint(o, *svc)
	if err != nil {
		return err
	}
	c := newClient(o)
	defer c.close()
	targets, err := replayTargets(ctx, c, ep, rest, reason)
	if err != nil {
		return err
	}
	outcomes := make([]replayOutcome, 0, len(targets))
	for _, d := range targets {
		out, err := replayOne(ctx, c, ep, d, dry)
		if err != nil {
			return err
		}
		outcomes = append(outcomes, out)
	}
	return reportReplays(o, outcomes, dry)
}

// replayTargets are the entries named by id, or every entry with reason.
func replayTargets(ctx context.Context, c *client, ep endpoint, ids []string, reason string) ([]deadLetter, error) {
	if reason == "" {
		out := make([]deadLetter, 0, len(ids))
		for _, s := range ids {
			id, err := strconv.ParseInt(s, 10, 64)
			if err != nil || id < 1 {
				return nil, fmt.Errorf("%w: dead-letter id %q is not a positive integer", errUsage, s)
			}
			out = append(out, deadLetter{DeadLetter: deadletter.DeadLetter{ID: id}})
		}
		return out, nil
	}
	items, _, _, err := fetchPages[deadLetter](ctx, c, ep, "/v1/dlq", url.Values{"reason": {reason}},
		&pageOptions{limit: 1000, all: true}, "dead letters")
	return items, err
}

// replayOne replays (or dry-runs) one entry. A 401 or 403 stops the run: it
// is returned as the error; every other answer is an outcome.
func replayOne(ctx context.Context, c *client, ep endpoint, d deadLetter, dry bool) (replayOutcome, error) {
	var q url.Values
	if dry {
		q = url.Values{"dry_run": {"true"}}
	}
	body, err := c.do(ctx, ep, http.MethodPost, fmt.Sprintf("/v1/dlq/%d/replay", d.ID), q, true)
	out := replayOutcome{ID: d.ID, Reason: string(d.Reason), Answer: body}
	var pe *problemError
	switch {
	case errors.As(err, &pe) && (pe.status == http.StatusUnauthorized || pe.status == http.StatusForbidden):
		return out, err
	case errors.As(err, &pe):
		out.Failed, out.Outcome, out.Detail = true, problemOutcome(pe), pe.Error()
		return out, nil
	case err != nil:
		return out, err
	}
	if dry {
		var a adminapi.DryRunAnswer
		err = json.Unmarshal(body, &a)
		out.Outcome, out.Detail = dryRunOutcome(a)
	} else {
		var a deadletter.ReplayAnswer
		err = json.Unmarshal(body, &a)
		out.Outcome, out.Detail = replayedOutcome(a)
	}
	if err != nil {
		return out, fmt.Errorf("replay of dead letter %d: the answer is not JSON: %w", d.ID, err)
	}
	return out, nil
}

// problemOutcome names a replay's error answer.
func problemOutcome(pe *problemError) string {
	switch pe.status {
	case http.StatusUnprocessableEntity:
		return "still invalid"
	case http.StatusServiceUnavailable:
		return "failed"
	case http.StatusNotFound:
		return "not found"
	}
	return fmt.Sprintf("error %d", pe.status)
}

// replayedOutcome describes a successful replay answer.
func replayedOutcome(a deadletter.ReplayAnswer) (string, string) {
	stored, existing := 0, 0
	for _, g := range a.Result.Groups {
		stored += g.Stored
		existing += g.Existing
	}
	detail := fmt.Sprintf("status %s: %d key(s) stored, %d already present", a.Result.Status, stored, existing)
	if a.AlreadyReplayed {
		return "already replayed", "recorded result " + detail
	}
	return "replayed", detail
}

// dryRunOutcome describes a dry-run answer.
func dryRunOutcome(a adminapi.DryRunAnswer) (string, string) {
	missing, existing := 0, 0
	for _, g := range a.Groups {
		missing += g.Missing
		existing += g.Existing
	}
	switch a.Expect {
	case "save":
		return "would replay", fmt.Sprintf("%d group(s): %d key(s) to put, %d already present", len(a.Groups), missing, existing)
	case "fail":
		return "would fail", a.Reason + ": " + a.Detail
	case "invalid":
		return "not replayable", a.Reason + ": " + a.Detail
	case "already_replayed":
		return "already replayed", "a replay answers the recorded result"
	}
	return a.Expect, a.Detail
}

// reportReplays prints each outcome and a summary; any failed replay (not
// a dry run) makes the run fail.
func reportReplays(o *clientOptions, outcomes []replayOutcome, dry bool) error {
	counts := map[string]int{}
	failed := 0
	for _, out := range outcomes {
		counts[out.Outcome]++
		if out.Failed {
			failed++
		}
	}
	if o.json {
		if err := writeValue(stdout, map[string]any{"dry_run": dry, "results": outcomes, "summary": counts}); err != nil {
			return err
		}
	} else if err := replayTable(stdout, outcomes, counts, dry); err != nil {
		return err
	}
	if failed > 0 && !dry {
		return fmt.Errorf("%w: %d of %d dead letters not replayed", errReplayFailed, failed, len(outcomes))
	}
	if failed > 0 {
		return fmt.Errorf("%w: %d of %d dry runs not answered", errReplayFailed, failed, len(outcomes))
	}
	return nil
}

// replayTable prints the outcomes and the summary line.
func replayTable(w io.Writer, outcomes []replayOutcome, counts map[string]int, dry bool) error {
	tw := newTable(w, "ID", "REASON", "OUTCOME", "DETAIL")
	for _, out := range outcomes {
		row(tw, out.ID, orDash(out.Reason), out.Outcome, out.Detail)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	order := []string{"replayed", "already replayed", "still invalid", "failed", "not found"}
	label := "replay"
	if dry {
		order = []string{"would replay", "would fail", "not replayable", "already replayed", "not found"}
		label = "dry run"
	}
	fmt.Fprintf(w, "%s: %d dead letter(s)", label, len(outcomes))
	for _, k := range order {
		fmt.Fprintf(w, ", %d %s", counts[k], k)
		delete(counts, k)
	}
	for _, k := range slices.Sorted(maps.Keys(counts)) {
		fmt.Fprintf(w, ", %d %s", counts[k], k)
	}
	fmt.Fprintln(w)
	return nil
}

// addDLQServiceFlag registers --service, the service whose dead letters a
// dlq command reads (default sender).
func addDLQServiceFlag(fs *flag.FlagSet) *string {
	return fs.String("service", "sender", "the service whose dead letters to use: sender, scheduler or gpuworker (the first --gpuworker-url)")
}

// dlqEndpoint is the endpoint of service's dead-letter routes.
func dlqEndpoint(o *clientOptions, service string) (endpoint, error) {
	switch service {
	case "sender":
		return o.sender, nil
	case "scheduler":
		return o.scheduler, nil
	case "gpuworker":
		if eps := o.gpuworkerEndpoints(); len(eps) > 0 {
			return eps[0], nil
		}
		return endpoint{}, fmt.Errorf("%w: no --gpuworker-url", errUsage)
	}
	return endpoint{}, fmt.Errorf("%w: --service %q is not sender, scheduler or gpuworker", errUsage, service)
}
