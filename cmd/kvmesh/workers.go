package main

import (
	"context"
	"flag"
	"fmt"
	"io"

	"github.com/kvmesh/kvmesh/pkg/adminapi"
)

func init() {
	register("workers", "list the gpuworkers the sender routes puts through, with their pools", runWorkers)
}

// worker is one entry of the sender's GET /v1/workers, with the pool
// summary the CLI adds.
type worker struct {
	adminapi.Worker
	// Pool is read from the worker itself (alive workers only).
	Pool *poolSummary `json:"pool,omitempty"`
	// PoolError says why the pool could not be read.
	PoolError string `json:"pool_error,omitempty"`
}

// poolSummary sums a gpuworker's GET /v1/pool over its groups.
type poolSummary struct {
	InUse  int `json:"in_use"`
	Blocks int `json:"blocks"`
}

func runWorkers(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("workers", flag.ContinueOnError)
	fs.SetOutput(stderr)
	o := addClientFlags(fs)
	f := addListFilters(fs, "only this engine's workers", "only alive or only stale workers")
	if rest, err := parseFlags(fs, args); err != nil || len(rest) > 0 {
		return usageOr(err, "workers takes no arguments: %q", rest)
	}
	c := newClient(o)
	defer c.close()
	items, _, _, err := fetchPages[worker](ctx, c, o.sender, "/v1/workers", f.query(), &pageOptions{limit: 1000, all: true}, "workers")
	if err != nil {
		return err
	}
	for i := range items {
		if items[i].Alive {
			items[i].Pool, items[i].PoolError = readPool(ctx, c, items[i].Addr)
		}
	}
	return printPage(o, items, nil, "", workersTable)
}

// readPool sums a worker's pool, or says why it could not be read.
func readPool(ctx context.Context, c *client, addr string) (*poolSummary, string) {
	ep := endpoint{name: "gpuworker", url: addr, flag: "KVMESH_DATAPLANE_URL on that worker", env: "check the worker registry"}
	var p adminapi.PoolAnswer
	if _, err := c.getJSON(ctx, ep, "/v1/pool", nil, &p); err != nil {
		return nil, err.Error()
	}
	var s poolSummary
	for _, g := range p.Groups {
		s.InUse += g.InUse
		s.Blocks += g.Blocks
	}
	return &s, ""
}

// workersTable prints the workers as a table.
func workersTable(w io.Writer, items []worker) error {
	tw := newTable(w, "ENGINE", "RANK", "ADDR", "STATE", "HEARTBEAT", "POOL")
	for _, wk := range items {
		pool := "-"
		switch {
		case wk.Pool != nil:
			pool = fmt.Sprintf("%d/%d blocks in use", wk.Pool.InUse, wk.Pool.Blocks)
		case wk.PoolError != "":
			pool = "unreachable"
		}
		row(tw, wk.EngineID, wk.Rank.String(), wk.Addr, wk.State, fmt.Sprintf("%.1fs ago", wk.HeartbeatAgeSeconds), pool)
	}
	return tw.Flush()
}
