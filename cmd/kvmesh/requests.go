package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"net/url"

	"github.com/kvmesh/kvmesh/pkg/adminapi"
)

func init() {
	register("requests", "list and show the scheduler's request trackers (requests list|show)", runRequests)
}

// runRequests dispatches requests list and show.
func runRequests(ctx context.Context, args []string) error {
	sub := map[string]func(context.Context, []string) error{"list": requestsList, "show": requestsShow}
	if len(args) == 0 || sub[args[0]] == nil {
		fmt.Fprintln(stderr, "usage: kvmesh requests list [--engine E] [--state S] [--limit N] [--cursor C] [--all]\n"+
			"       kvmesh requests show ENGINE REQUEST\n"+
			"Each takes the shared flags; run 'kvmesh requests list -h' for them.")
		return fmt.Errorf("%w: requests needs list or show", errUsage)
	}
	return sub[args[0]](ctx, args[1:])
}

func requestsList(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("requests list", flag.ContinueOnError)
	fs.SetOutput(stderr)
	o := addClientFlags(fs)
	p := addPageFlags(fs)
	f := addListFilters(fs, "only this engine's requests",
		"only requests in this state (waiting, running, preempted, finishing, done, errored)")
	if rest, err := parseFlags(fs, args); err != nil || len(rest) > 0 {
		return usageOr(err, "requests list takes no arguments: %q", rest)
	}
	c := newClient(o)
	defer c.close()
	items, raw, next, err := fetchPages[adminapi.RequestSummary](ctx, c, o.scheduler, "/v1/requests", f.query(), p, "requests")
	if err != nil {
		return err
	}
	return printPage(o, items, raw, next, requestsTable)
}

// requestsTable prints request summaries as a table.
func requestsTable(w io.Writer, items []adminapi.RequestSummary) error {
	tw := newTable(w, "ENGINE", "REQUEST", "STATE", "TOKENS", "SAVED", "TASKS", "UPDATED", "ERROR")
	for _, r := range items {
		row(tw, r.EngineID, r.RequestID, r.State, r.TokenLen, r.NumSavedTokens, r.TasksPending, formatTime(r.UpdatedAt), orDash(r.Error))
	}
	return tw.Flush()
}

func requestsShow(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("requests show", flag.ContinueOnError)
	fs.SetOutput(stderr)
	o := addClientFlags(fs)
	rest, err := parseFlags(fs, args)
	if err != nil || len(rest) != 2 {
		return usageOr(err, "requests show takes ENGINE and REQUEST, got %q", rest)
	}
	c := newClient(o)
	defer c.close()
	var d adminapi.RequestDetail
	raw, err := c.getJSON(ctx, o.scheduler, "/v1/requests/"+url.PathEscape(rest[0])+"/"+url.PathEscape(rest[1]), nil, &d)
	if err != nil {
		return err
	}
	if o.json {
		return writeJSON(stdout, raw)
	}
	return showRequest(stdout, d)
}

// showRequest prints one request: summary, coverage, tasks and errors.
func showRequest(w io.Writer, d adminapi.RequestDetail) error {
	tw := newTable(w, "FIELD", "VALUE")
	for _, f := range [][2]any{
		{"engine", d.EngineID}, {"request", d.RequestID}, {"model", d.Model}, {"state", d.State},
		{"tokens", d.TokenLen}, {"saved tokens", d.NumSavedTokens}, {"tasks outstanding", d.TasksPending},
		{"last seq", d.LastSeq}, {"created", formatTime(d.CreatedAt)}, {"updated", formatTime(d.UpdatedAt)},
		{"awaiting decision", orDash(d.AwaitingDecision)},
	} {
		row(tw, f[0], f[1])
	}
	if d.FinishedAt != nil {
		row(tw, "finished", formatTime(*d.FinishedAt))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintln(w)
	tw = newTable(w, "GROUP", "KIND", "EMITTED", "SAVED", "STORED", "EXISTING", "SKIPPED", "DEAD-LETTERED", "FAILED")
	for _, c := range d.Coverage {
		row(tw, c.Group, c.Kind, c.EmittedTokens, c.SavedTokens, c.Stored, c.Existing, c.Skipped, c.DeadLettered, c.Failed)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	for _, t := range d.Tasks {
		fmt.Fprintf(w, "task %s: %s [%d, %d)\n", t.ID, t.Kind, t.Start, t.End)
	}
	for _, e := range d.Errors {
		fmt.Fprintf(w, "error (%s): %s\n", e.Source, e.Error)
	}
	return nil
}
