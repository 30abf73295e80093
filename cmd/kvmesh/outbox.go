package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"

	"github.com/kvmesh/kvmesh/pkg/database"
)

func init() {
	register("outbox", "list and retry outbox rows that could not be published (outbox failed|retry)", runOutbox)
}

// runOutbox dispatches outbox failed and retry.
func runOutbox(ctx context.Context, args []string) error {
	sub := map[string]func(context.Context, []string) error{"failed": outboxFailed, "retry": outboxRetry}
	if len(args) == 0 || sub[args[0]] == nil {
		fmt.Fprintln(stderr, "usage: kvmesh outbox failed [--limit N] [--cursor C] [--all]\n"+
			"       kvmesh outbox retry ID...\n"+
			"Each takes the shared flags; run 'kvmesh outbox failed -h' for them.")
		return fmt.Errorf("%w: outbox needs failed or retry", errUsage)
	}
	return sub[args[0]](ctx, args[1:])
}

func outboxFailed(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("outbox failed", flag.ContinueOnError)
	fs.SetOutput(stderr)
	o := addClientFlags(fs)
	p := addPageFlags(fs)
	if rest, err := parseFlags(fs, args); err != nil || len(rest) > 0 {
		return usageOr(err, "outbox failed takes no arguments: %q", rest)
	}
	c := newClient(o)
	defer c.close()
	items, raw, next, err := fetchPages[database.FailedRow](ctx, c, o.scheduler, "/v1/outbox/failed", url.Values{}, p, "failed rows")
	if err != nil {
		return err
	}
	return printPage(o, items, raw, next, failedTable)
}

// failedTable prints failed outbox rows as a table.
func failedTable(w io.Writer, items []database.FailedRow) error {
	tw := newTable(w, "ID", "FAILED", "TOPIC", "KEY", "BYTES", "ATTEMPTS", "REASON")
	for _, f := range items {
		row(tw, f.ID, formatTime(f.FailedAt), f.Topic, orDash(f.Key), f.ValueBytes, f.Attempts, f.Reason)
	}
	return tw.Flush()
}

// retryOutcome is what happened to one row of a retry run.
type retryOutcome struct {
	ID      int64  `json:"id"`
	Outcome string `json:"outcome"`
	Detail  string `json:"detail,omitempty"`
	Failed  bool   `json:"failed"`
}

func outboxRetry(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("outbox retry", flag.ContinueOnError)
	fs.SetOutput(stderr)
	o := addClientFlags(fs)
	rest, err := parseFlags(fs, args)
	if err != nil || len(rest) == 0 {
		return usageOr(err, "outbox retry takes outbox row ids")
	}
	ids := make([]int64, 0, len(rest))
	for _, s := range rest {
		id, err := strconv.ParseInt(s, 10, 64)
		if err != nil || id < 1 {
			return fmt.Errorf("%w: outbox row id %q is not a positive integer", errUsage, s)
		}
		ids = append(ids, id)
	}
	c := newClient(o)
	defer c.close()
	outcomes := make([]retryOutcome, 0, len(ids))
	failed := 0
	for _, id := range ids {
		out, err := retryRow(ctx, c, o.scheduler, id)
		if err != nil {
			return err
		}
		if out.Failed {
			failed++
		}
		outcomes = append(outcomes, out)
	}
	if o.json {
		if err := writeValue(stdout, map[string]any{"results": outcomes}); err != nil {
			return err
		}
	} else {
		tw := newTable(stdout, "ID", "OUTCOME", "DETAIL")
		for _, out := range outcomes {
			row(tw, out.ID, out.Outcome, orDash(out.Detail))
		}
		if err := tw.Flush(); err != nil {
			return err
		}
	}
	if failed > 0 {
		return fmt.Errorf("%w: %d of %d rows not retried", errRetryFailed, failed, len(ids))
	}
	return nil
}

// retryRow retries one row. A 401 or 403 stops the run: it is returned as
// the error; every other answer is an outcome.
func retryRow(ctx context.Context, c *client, ep endpoint, id int64) (retryOutcome, error) {
	_, err := c.do(ctx, ep, http.MethodPost, fmt.Sprintf("/v1/outbox/%d/retry", id), nil, true)
	out := retryOutcome{ID: id, Outcome: "pending"}
	var pe *problemError
	switch {
	case errors.As(err, &pe) && (pe.status == http.StatusUnauthorized || pe.status == http.StatusForbidden):
		return out, err
	case errors.As(err, &pe):
		out.Failed, out.Detail = true, pe.Error()
		switch pe.status {
		case http.StatusNotFound:
			out.Outcome = "not found"
		case http.StatusConflict:
			out.Outcome = "not failed"
		default:
			out.Outcome = fmt.Sprintf("error %d", pe.status)
		}
		return out, nil
	case err != nil:
		return out, err
	}
	return out, nil
}
