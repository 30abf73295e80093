package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"net/url"
	"strconv"

	"github.com/kvmesh/kvmesh/pkg/adminapi"
)

func init() {
	register("removals", "what left the store: by cause, with the blocks' ages, for one tenant or all (the sender's GET /v1/removals)", runRemovals)
}

func runRemovals(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("removals", flag.ContinueOnError)
	fs.SetOutput(stderr)
	o := addClientFlags(fs)
	tenant := fs.String("tenant", "", "only this tenant's removals (-tenant= for the tenant-less key space); not given: every tenant's")
	cause := fs.String("cause", "", "only this cause: evicted, expired, del or flushed")
	since := fs.String("since", "1h", "the window: removals of the last since (a duration such as 1h or 15m)")
	limit := fs.Int("limit", 20, "how many of the newest records to list (1 to 1000)")
	if rest, err := parseFlags(fs, args); err != nil || len(rest) > 0 {
		return usageOr(err, "removals takes no arguments: %q", rest)
	}
	q := url.Values{"since": {*since}, "limit": {strconv.Itoa(*limit)}}
	fs.Visit(func(f *flag.Flag) {
		if f.Name == "tenant" {
			q.Set("tenant", *tenant)
		}
	})
	if *cause != "" {
		q.Set("cause", *cause)
	}
	c := newClient(o)
	defer c.close()
	var r adminapi.Removals
	raw, err := c.getJSON(ctx, o.sender, "/v1/removals", q, &r)
	if err != nil {
		return err
	}
	if o.json {
		return writeJSON(stdout, raw)
	}
	return showRemovals(stdout, r)
}

// showRemovals prints the removals per cause, then the newest records.
func showRemovals(w io.Writer, r adminapi.Removals) error {
	who := "every tenant"
	if r.Tenant != nil {
		who = "tenant " + strconv.Quote(*r.Tenant)
	}
	fmt.Fprintf(w, "removals of %s from %s to %s\n", who, formatTime(r.Since), formatTime(r.Until))
	tw := newTable(w, "CAUSE", "BLOCKS", "WITH AGE", "AGE MIN", "AGE AVG", "AGE MAX")
	for _, c := range r.ByCause {
		row(tw, c.Cause, c.Blocks, c.AgesKnown, seconds(c.AgeMinS), seconds(c.AgeAvgS), seconds(c.AgeMaxS))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if len(r.Recent) == 0 {
		return nil
	}
	fmt.Fprintln(w)
	tw = newTable(w, "REMOVED", "TENANT", "CAUSE", "BLOCKS", "AGE MIN", "AGE MAX", "NAMESPACE")
	for _, e := range r.Recent {
		row(tw, formatTime(e.RemovedAt), orDash(e.Tenant), e.Cause, e.Blocks, seconds(e.AgeMinS), seconds(e.AgeMaxS), e.Namespace)
	}
	return tw.Flush()
}

// seconds prints an age in seconds, or "-" when it is not known.
func seconds(s *float64) string {
	if s == nil {
		return "-"
	}
	return strconv.FormatFloat(*s, 'f', 1, 64) + "s"
}
