package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"mime"
	"net/http"
	"net/url"
	"os"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/kvmesh/kvmesh/pkg/adminapi"
	"github.com/kvmesh/kvmesh/pkg/config"
	"github.com/kvmesh/kvmesh/pkg/httpserver"
	"github.com/kvmesh/kvmesh/pkg/service"
)

// stdout receives command output; tests replace it.
var stdout io.Writer = os.Stdout

// Errors of the admin commands (dlq, outbox, requests, workers, status).
var (
	// errUnreachable reports a service that could not be reached.
	errUnreachable = errors.New("not reachable")
	// errProblem reports a service that answered with an error status
	// (a *problemError wraps it).
	errProblem = errors.New("service error")
	// errReplayFailed reports a replay run in which some entry was not
	// replayed (or a dry run was not answered).
	errReplayFailed = errors.New("some replays failed")
	// errRetryFailed reports an outbox retry run in which some row was not
	// put back on the relay path.
	errRetryFailed = errors.New("some outbox retries failed")
	// errNotReady reports a status run in which some service was not ready.
	errNotReady = errors.New("not every service is ready")
	// errDegraded reports a status run in which every service was ready
	// but some failed an optional check (the lookup without its store
	// fails open and answers 0).
	errDegraded = errors.New("not every service is healthy")
)

// maxAnswerBytes bounds an answer the CLI reads.
const maxAnswerBytes = 64 << 20

// endpoint is one service the CLI talks to, and how to point the CLI at it.
type endpoint struct {
	// name is the service's name (lookup, scheduler, sender, gpuworker).
	name string
	// url is its base URL.
	url string
	// flag and env name the setting that changes url, for error messages.
	flag, env string
}

// clientOptions are the flags every admin command shares.
type clientOptions struct {
	lookup, scheduler, sender endpoint
	gpuworkers                urlList
	token                     string
	json                      bool
	timeout                   time.Duration
}

// urlList is a repeatable flag of URLs that also takes comma lists; the
// first Set replaces the default.
type urlList struct {
	urls []string
	set  bool
}

// String joins the URLs with commas.
func (l *urlList) String() string { return strings.Join(l.urls, ",") }

// Set adds the comma-separated URLs of one flag occurrence.
func (l *urlList) Set(v string) error {
	if !l.set {
		l.urls, l.set = nil, true
	}
	for _, u := range strings.Split(v, ",") {
		if u = strings.TrimSpace(u); u != "" {
			l.urls = append(l.urls, strings.TrimRight(u, "/"))
		}
	}
	return nil
}

// addClientFlags registers the shared flags, with defaults from the
// environment, on fs.
func addClientFlags(fs *flag.FlagSet) *clientOptions {
	urls := envURLs()
	o := &clientOptions{
		lookup:    endpoint{name: "lookup", flag: "--lookup-url", env: "KVMESH_LOOKUP_URL"},
		scheduler: endpoint{name: "scheduler", flag: "--scheduler-url", env: "KVMESH_SCHEDULER_URL"},
		sender:    endpoint{name: "sender", flag: "--sender-url", env: "KVMESH_SENDER_URL"},
	}
	for _, e := range []struct {
		ep  *endpoint
		url string
	}{{&o.lookup, urls.Lookup}, {&o.scheduler, urls.Scheduler}, {&o.sender, urls.Sender}} {
		fs.StringVar(&e.ep.url, strings.TrimPrefix(e.ep.flag, "--"), e.url,
			fmt.Sprintf("base URL of the %s (env %s)", e.ep.name, e.ep.env))
	}
	o.gpuworkers.urls = strings.Split(urls.GPUWorker, ",")
	fs.Var(&o.gpuworkers, "gpuworker-url", "base URL of a gpuworker; repeat the flag or give a comma list (env KVMESH_GPUWORKER_URL)")
	fs.StringVar(&o.token, "token", envAdminToken(), "admin bearer token for mutating routes (env "+httpserver.AdminTokenEnv+")")
	fs.BoolVar(&o.json, "json", false, "print the services' JSON instead of a table")
	fs.DurationVar(&o.timeout, "timeout", 10*time.Second, "time limit of each HTTP request")
	return o
}

// envAdminToken is the operator token the services read
// (KVMESH_ADMIN_TOKEN or KVMESH_ADMIN_TOKEN_FILE), read through the same
// struct; a token that cannot be read is reported on stderr and left empty.
func envAdminToken() string {
	var a service.Admin
	if err := config.Overlay(&a, os.LookupEnv); err != nil {
		fmt.Fprintf(stderr, "kvmesh: %v\n", err)
		return ""
	}
	return a.AdminToken
}

// envURLs are the services' URLs from the environment (serviceURLs); every
// one is text, so nothing there can be refused.
func envURLs() serviceURLs {
	urls, err := loadSettings[serviceURLs]()
	if err != nil {
		fmt.Fprintf(stderr, "kvmesh: %v\n", err)
	}
	return urls
}

// gpuworkerEndpoints lists the configured gpuworkers.
func (o *clientOptions) gpuworkerEndpoints() []endpoint {
	out := make([]endpoint, 0, len(o.gpuworkers.urls))
	for _, u := range o.gpuworkers.urls {
		out = append(out, endpoint{name: "gpuworker", url: strings.TrimRight(u, "/"), flag: "--gpuworker-url", env: "KVMESH_GPUWORKER_URL"})
	}
	return out
}

// parseFlags parses args with flags and positional arguments in any order
// and returns the positional ones.
func parseFlags(fs *flag.FlagSet, args []string) ([]string, error) {
	var rest []string
	for {
		if err := fs.Parse(args); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				return nil, err
			}
			return nil, fmt.Errorf("%w: %w", errUsage, err)
		}
		args = fs.Args()
		if len(args) == 0 {
			return rest, nil
		}
		rest = append(rest, args[0])
		args = args[1:]
	}
}

// client makes the CLI's HTTP requests.
type client struct {
	hc    *http.Client
	token string
}

// newClient returns a client with o's timeout and token; close releases
// its connections.
func newClient(o *clientOptions) *client {
	return &client{hc: &http.Client{Timeout: o.timeout, Transport: cliTransport()}, token: o.token}
}

// close releases the client's idle connections.
func (c *client) close() { c.hc.CloseIdleConnections() }

// problemError is an error answer of a service.
type problemError struct {
	ep      endpoint
	status  int
	problem httpserver.Problem
}

// Error reads "title: detail", with a hint for a missing or wrong token.
func (e *problemError) Error() string {
	msg := e.problem.Title
	if msg == "" {
		msg = http.StatusText(e.status)
	}
	if e.problem.Detail != "" {
		msg += ": " + e.problem.Detail
	}
	switch e.status {
	case http.StatusUnauthorized, http.StatusForbidden:
		msg += " (pass --token or set " + httpserver.AdminTokenEnv + ")"
	}
	return msg
}

// Unwrap returns errProblem.
func (e *problemError) Unwrap() error { return errProblem }

// do sends one request to ep and returns the answer's body when the status
// is 2xx. Any other status is a *problemError; a transport failure names
// the URL and the setting to fix it.
func (c *client) do(ctx context.Context, ep endpoint, method, path string, q url.Values, admin bool) ([]byte, error) {
	return c.send(ctx, ep, method, path, q, admin, nil)
}

// send is do with a JSON request body (none when nil).
func (c *client) send(ctx context.Context, ep endpoint, method, path string, q url.Values, admin bool, body []byte) ([]byte, error) {
	target := ep.url + path
	if len(q) > 0 {
		target += "?" + q.Encode()
	}
	var rd io.Reader
	if body != nil {
		rd = bytes.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, target, rd)
	if err != nil {
		return nil, fmt.Errorf("%s URL %q: %w (set %s or %s)", ep.name, ep.url, err, ep.flag, ep.env)
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if admin && c.token != "" {
		req.Header.Set("Authorization", "Bearer "+c.token)
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		return nil, fmt.Errorf("%s at %s is %w: %w (set %s or %s)", ep.name, ep.url, errUnreachable, err, ep.flag, ep.env)
	}
	defer resp.Body.Close()
	answer, err := io.ReadAll(io.LimitReader(resp.Body, maxAnswerBytes))
	if err != nil {
		return nil, fmt.Errorf("%s at %s: reading the answer: %w", ep.name, ep.url, err)
	}
	if resp.StatusCode/100 == 2 {
		return answer, nil
	}
	pe := &problemError{ep: ep, status: resp.StatusCode}
	if mt, _, _ := mime.ParseMediaType(resp.Header.Get("Content-Type")); mt != httpserver.ContentTypeProblem ||
		json.Unmarshal(answer, &pe.problem) != nil {
		pe.problem = httpserver.Problem{Status: resp.StatusCode, Detail: strings.TrimSpace(string(answer))}
	}
	return nil, pe
}

// getJSON GETs path from ep and decodes the answer into out; it returns the
// raw answer too.
func (c *client) getJSON(ctx context.Context, ep endpoint, path string, q url.Values, out any) ([]byte, error) {
	body, err := c.do(ctx, ep, http.MethodGet, path, q, true)
	if err != nil {
		return nil, err
	}
	if err := json.Unmarshal(body, out); err != nil {
		return nil, fmt.Errorf("%s at %s: %s answered something that is not the expected JSON: %w", ep.name, ep.url, path, err)
	}
	return body, nil
}

// writeJSON prints raw JSON indented.
func writeJSON(w io.Writer, raw []byte) error {
	var buf bytes.Buffer
	if err := json.Indent(&buf, raw, "", "  "); err != nil {
		return fmt.Errorf("indent JSON: %w", err)
	}
	buf.WriteByte('\n')
	_, err := w.Write(buf.Bytes())
	return err
}

// writeValue prints v as indented JSON.
func writeValue(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// newTable returns a tab-aligned writer for a table on w; Flush prints it.
func newTable(w io.Writer, header ...string) *tabwriter.Writer {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, strings.Join(header, "\t"))
	return tw
}

// row prints one table row.
func row(tw *tabwriter.Writer, cells ...any) {
	parts := make([]string, len(cells))
	for i, c := range cells {
		parts[i] = strings.ReplaceAll(fmt.Sprint(c), "\t", " ")
	}
	fmt.Fprintln(tw, strings.Join(parts, "\t"))
}

// orDash returns s, or "-" when it is empty.
func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// page is the part of a paginated answer the CLI reads.
type page[T any] = adminapi.Page[T]

// pageOptions are the pagination flags of a list command.
type pageOptions struct {
	limit  int
	cursor string
	all    bool
}

// addPageFlags registers --limit, --cursor and --all on fs.
func addPageFlags(fs *flag.FlagSet) *pageOptions {
	p := &pageOptions{}
	fs.IntVar(&p.limit, "limit", 0, "page size, 1-1000 (default: the service's, 100)")
	fs.StringVar(&p.cursor, "cursor", "", "continue from the next cursor a previous page printed")
	fs.BoolVar(&p.all, "all", false, "follow the cursors and list every page")
	return p
}

// listFilters are the --engine and --state filters of a list command.
type listFilters struct {
	engine, state string
}

// addListFilters registers --engine and --state, with these usages, on fs.
func addListFilters(fs *flag.FlagSet, engineUsage, stateUsage string) *listFilters {
	f := &listFilters{}
	fs.StringVar(&f.engine, "engine", "", engineUsage)
	fs.StringVar(&f.state, "state", "", stateUsage)
	return f
}

// query returns the filters that are set as the query parameters engine_id
// and state.
func (f *listFilters) query() url.Values {
	q := url.Values{}
	if f.engine != "" {
		q.Set("engine_id", f.engine)
	}
	if f.state != "" {
		q.Set("state", f.state)
	}
	return q
}

// fetchPages GETs path with q and p's pagination: one page, or every page
// with --all (a progress line per page on stderr). It returns the items,
// the raw answer of a single page, and the next cursor.
func fetchPages[T any](ctx context.Context, c *client, ep endpoint, path string, q url.Values, p *pageOptions, what string) ([]T, []byte, string, error) {
	if p.limit != 0 {
		q.Set(httpserver.ParamLimit, fmt.Sprint(p.limit))
	}
	cursor := p.cursor
	var items []T
	for pages := 1; ; pages++ {
		if cursor != "" {
			q.Set(httpserver.ParamCursor, cursor)
		}
		var pg page[T]
		raw, err := c.getJSON(ctx, ep, path, q, &pg)
		if err != nil {
			return nil, nil, "", err
		}
		items = append(items, pg.Items...)
		if !p.all {
			return items, raw, pg.NextCursor, nil
		}
		if pg.NextCursor == "" {
			if pages > 1 {
				fmt.Fprintf(stderr, "%s: %d pages, %d %s\n", path, pages, len(items), what)
			}
			return items, nil, "", nil
		}
		fmt.Fprintf(stderr, "%s: page %d, %d %s so far\n", path, pages, len(items), what)
		cursor = pg.NextCursor
	}
}

// printPage prints a list: raw JSON of a single page or every item with
// --json, else the table and the next cursor.
func printPage[T any](o *clientOptions, items []T, raw []byte, next string, table func(io.Writer, []T) error) error {
	if o.json {
		if raw != nil {
			return writeJSON(stdout, raw)
		}
		if items == nil {
			items = []T{}
		}
		return writeValue(stdout, map[string]any{"items": items})
	}
	if err := table(stdout, items); err != nil {
		return err
	}
	if next != "" {
		fmt.Fprintf(stdout, "next cursor: %s\n", next)
	}
	return nil
}

// formatTime prints a time in UTC to the second, or "-".
func formatTime(t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	return t.UTC().Format("2006-01-02 15:04:05")
}
