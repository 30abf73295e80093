package httpserver_test

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/httpserver"
	"github.com/kvmesh/kvmesh/pkg/logging"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// testServer is a Server running on a real loopback listener.
type testServer struct {
	*httpserver.Server
	url    string
	client *http.Client
	logs   *testenv.SyncBuffer
	cancel context.CancelFunc
	done   chan error
}

// start runs a server built from opts (Addr and Logger filled in) after
// mount has added routes; cleanup stops it and requires Run to return nil.
func start(t *testing.T, opts httpserver.Options, mount func(*httpserver.Server)) *testServer {
	t.Helper()
	logs := &testenv.SyncBuffer{}
	if opts.Logger == nil {
		logger, err := logging.New(logs, "debug", "test")
		if err != nil {
			t.Fatal(err)
		}
		opts.Logger = logger
	}
	opts.Addr = "127.0.0.1:0"
	srv, err := httpserver.New(opts)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	if mount != nil {
		mount(srv)
	}
	if err := srv.Listen(); err != nil {
		t.Fatalf("Listen: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	ts := &testServer{
		Server: srv, url: "http://" + srv.Addr(), logs: logs, cancel: cancel,
		client: &http.Client{Transport: &http.Transport{}, Timeout: 10 * time.Second},
		done:   make(chan error, 1),
	}
	go func() { ts.done <- srv.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-ts.done; err != nil {
			t.Errorf("Run returned %v, want nil", err)
		}
		ts.client.CloseIdleConnections()
	})
	return ts
}

// response is a finished HTTP exchange.
type response struct {
	status int
	header http.Header
	body   []byte
}

// do sends one request and reads the whole response.
func (ts *testServer) do(t *testing.T, method, path, body string, header map[string]string) response {
	t.Helper()
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req, err := http.NewRequestWithContext(context.Background(), method, ts.url+path, rd)
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range header {
		req.Header.Set(k, v)
	}
	res, err := ts.client.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, path, err)
	}
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	if err != nil {
		t.Fatalf("%s %s: read body: %v", method, path, err)
	}
	return response{status: res.StatusCode, header: res.Header, body: b}
}

// problem decodes a problem response and checks its media type and status.
func (r response) problem(t *testing.T, wantStatus int) httpserver.Problem {
	t.Helper()
	if r.status != wantStatus {
		t.Fatalf("status = %d, want %d; body %s", r.status, wantStatus, r.body)
	}
	if ct := r.header.Get("Content-Type"); ct != httpserver.ContentTypeProblem {
		t.Fatalf("Content-Type = %q, want %q", ct, httpserver.ContentTypeProblem)
	}
	var p httpserver.Problem
	if err := json.Unmarshal(r.body, &p); err != nil {
		t.Fatalf("problem body %s: %v", r.body, err)
	}
	if p.Status != wantStatus || p.Type != "about:blank" || p.Title == "" {
		t.Fatalf("problem %+v: want status %d, type about:blank and a title", p, wantStatus)
	}
	return p
}

// eventually polls cond until it holds or a deadline passes.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond) // polling interval, not synchronisation
	}
}

// discardLogger is a logger for servers whose logs a test ignores.
func discardLogger() *slog.Logger {
	return slog.New(slog.DiscardHandler)
}
