package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net/url"
	"time"
)

func init() {
	register("requests", "list and show the scheduler's request trackers (requests list|show)", runRequests)
}

// requestSummary is the part of a scheduler request the CLI prints.
type requestSummary struct {
	EngineID       string     `json:"engine_id"`
	RequestID      string     `json:"request_id"`
	Model          string     `json:"model"`
	State          string     `json:"state"`
	Error          string     `json:"error"`
	LastSeq        int64      `json:"last_seq"`
	TokenLen       int        `json:"token_len"`
	NumSavedTokens int        `json:"num_saved_tokens"`
	TasksPending   int        `json:"tasks_outstanding"`
	CreatedAt      time.Time  `json:"created_at"`
	UpdatedAt      time.Time  `json:"updated_at"`
	FinishedAt     *time.Time `json:"finished_at"`
}

// requestDetail is the part of GET /v1/requests/{engine}/{request} the CLI
// prints besides the summary.
type requestDetail struct {
	requestSummary
	Coverage []struct {
		Group         int    `json:"group"`
		Kind          string `json:"kind"`
		EmittedTokens int    `json:"emitted_tokens"`
		SavedTokens   int    `json:"saved_tokens"`
		Stored        int    `json:"stored"`
		Existing      int    `json:"existing"`
		Skipped       int    `json:"skipped"`
		DeadLettered  int    `json:"dead_lettered"`
		Failed        int    `json:"failed"`
	} `json:"coverage"`
	Tasks []struct {
		TaskID string `json:"task_id"`
		Kind   string `json:"kind"`
		Start  int    `json:"start"`
		End    int    `json:"end"`
	} `json:"tasks"`
	Errors []struct {
		Source string `json:"source"`
		Error  string `json:"error"`
	} `json:"errors"`
	AwaitingDecision string          `json:"awaiting_decision"`
	Tracker          json.RawMessage `json:"tracker"`
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
	items, raw, next, err := fetchPages[requestSummary](ctx, c, o.scheduler, "/v1/requests", f.query(), p, "requests")
	if err != nil {
		return err
	}
	return printPage(o, items, raw, next, requestsTable)
}

// requestsTable prints request summaries as a table.
func requestsTable(w io.Writer, items []requestSummary) error {
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
	var d requestDetail
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
func showRequest(w io.Writer, d requestDetail) error {
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
		fmt.Fprintf(w, "task %s: %s [%d, %d)\n", t.TaskID, t.Kind, t.Start, t.End)
	}
	for _, e := range d.Errors {
		fmt.Fprintf(w, "error (%s): %s\n", e.Source, e.Error)
	}
	return nil
}
