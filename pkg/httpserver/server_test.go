package httpserver_test

import (
	"context"
	"encoding/json"
	"errors"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/kvmesh/kvmesh/pkg/httpserver"
)

func mountItems(s *httpserver.Server) {
	s.Router().Get("/v1/items/{id}", func(w http.ResponseWriter, r *http.Request) {
		_ = httpserver.WriteJSON(w, http.StatusOK, map[string]string{"id": chi.URLParam(r, "id")})
	})
}

func TestHealthz(t *testing.T) {
	ts := start(t, httpserver.Options{Service: "sender"}, nil)
	res := ts.do(t, http.MethodGet, "/healthz", "", nil)
	if res.status != http.StatusOK || res.header.Get("Content-Type") != httpserver.ContentTypeJSON {
		t.Fatalf("GET /healthz = %d %q", res.status, res.header.Get("Content-Type"))
	}
	var body map[string]string
	if err := json.Unmarshal(res.body, &body); err != nil || body["status"] != "ok" || body["service"] != "sender" {
		t.Fatalf("GET /healthz body %s (%v): want status ok, service sender", res.body, err)
	}
	if res.header.Get(httpserver.HeaderRequestID) == "" {
		t.Fatal("response has no X-Request-Id")
	}
}

func TestRequestIDEchoedOrReplaced(t *testing.T) {
	ts := start(t, httpserver.Options{}, nil)
	tests := []struct {
		in       string
		wantSame bool
	}{
		{"abc-123.x:y_z", true},
		{"bad id with spaces", false},
		{strings.Repeat("a", 200), false},
	}
	for _, tt := range tests {
		res := ts.do(t, http.MethodGet, "/healthz", "", map[string]string{httpserver.HeaderRequestID: tt.in})
		got := res.header.Get(httpserver.HeaderRequestID)
		if (got == tt.in) != tt.wantSame || got == "" {
			t.Errorf("request id %q echoed as %q, want same=%v", tt.in, got, tt.wantSame)
		}
	}
}

func TestReadyz(t *testing.T) {
	hang := make(chan struct{})
	t.Cleanup(func() { close(hang) })
	ok := httpserver.ReadyCheck{Name: "postgres", Check: func(context.Context) error { return nil }}
	bad := httpserver.ReadyCheck{Name: "kafka", Check: func(context.Context) error { return errors.New("no brokers") }}
	stuck := httpserver.ReadyCheck{Name: "redis", Check: func(context.Context) error { <-hang; return nil }}

	tests := []struct {
		name       string
		checks     []httpserver.ReadyCheck
		wantStatus int
		wantFailed []string
	}{
		{"all ok", []httpserver.ReadyCheck{ok}, http.StatusOK, nil},
		{"one failing", []httpserver.ReadyCheck{ok, bad}, http.StatusServiceUnavailable, []string{"kafka"}},
		{"check ignoring its deadline", []httpserver.ReadyCheck{ok, stuck, bad}, http.StatusServiceUnavailable, []string{"kafka", "redis"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ts := start(t, httpserver.Options{Ready: tt.checks, ReadyTimeout: 50 * time.Millisecond}, nil)
			res := ts.do(t, http.MethodGet, "/readyz", "", nil)
			if tt.wantStatus == http.StatusOK {
				var body struct {
					Status string                            `json:"status"`
					Checks map[string]httpserver.CheckResult `json:"checks"`
				}
				if err := json.Unmarshal(res.body, &body); err != nil || res.status != http.StatusOK ||
					body.Checks["postgres"].Status != httpserver.StatusOK {
					t.Fatalf("GET /readyz = %d %s, want 200 with postgres ok", res.status, res.body)
				}
				return
			}
			p := res.problem(t, tt.wantStatus)
			for _, name := range tt.wantFailed {
				if !strings.Contains(p.Detail, name) {
					t.Errorf("detail %q does not name failed check %s", p.Detail, name)
				}
			}
			if strings.Contains(p.Detail, "postgres") {
				t.Errorf("detail %q names the passing check", p.Detail)
			}
			failed, _ := p.Extras["failed"].([]any)
			if len(failed) != len(tt.wantFailed) {
				t.Errorf("failed = %v, want %v", p.Extras["failed"], tt.wantFailed)
			}
		})
	}
}

func TestMetricsCountRequestsByRoute(t *testing.T) {
	ts := start(t, httpserver.Options{}, mountItems)
	for _, id := range []string{"1", "2"} {
		if res := ts.do(t, http.MethodGet, "/v1/items/"+id, "", nil); res.status != http.StatusOK {
			t.Fatalf("GET item = %d", res.status)
		}
	}
	ts.do(t, http.MethodGet, "/no/such/path", "", nil)

	want := []string{
		`kvmesh_http_requests_total{code="200",method="GET",route="/v1/items/{id}"} 2`,
		`kvmesh_http_requests_total{code="404",method="GET",route="unmatched"} 1`,
		`kvmesh_http_request_duration_seconds_count{code="200",method="GET",route="/v1/items/{id}"} 2`,
		"go_goroutines",
		"process_cpu_seconds_total",
	}
	var text string
	eventually(t, "metrics for both requests", func() bool {
		res := ts.do(t, http.MethodGet, "/metrics", "", nil)
		text = string(res.body)
		for _, w := range want {
			if !strings.Contains(text, w) {
				return false
			}
		}
		return true
	})
	if strings.Contains(text, "/no/such/path") {
		t.Fatal("an unmatched path became a metric label")
	}
}

func TestSharedRegistryAcrossServers(t *testing.T) {
	reg := prometheus.NewRegistry()
	a := start(t, httpserver.Options{Registry: reg}, mountItems)
	b := start(t, httpserver.Options{Registry: reg}, mountItems)
	a.do(t, http.MethodGet, "/v1/items/1", "", nil)
	b.do(t, http.MethodGet, "/v1/items/1", "", nil)
	want := `kvmesh_http_requests_total{code="200",method="GET",route="/v1/items/{id}"} 2`
	eventually(t, "both servers counted in the shared registry", func() bool {
		return strings.Contains(string(a.do(t, http.MethodGet, "/metrics", "", nil).body), want)
	})
}

func TestNotFoundAndMethodNotAllowedAreProblems(t *testing.T) {
	ts := start(t, httpserver.Options{}, func(s *httpserver.Server) {
		mountItems(s)
		s.Router().Route("/v1/sub", func(r chi.Router) {
			r.Get("/x", func(http.ResponseWriter, *http.Request) {})
			r.Delete("/x", func(http.ResponseWriter, *http.Request) {})
		})
	})
	res := ts.do(t, http.MethodGet, "/v1/nothing", "", map[string]string{httpserver.HeaderRequestID: "req-1"})
	p := res.problem(t, http.StatusNotFound)
	if p.Instance != "/v1/nothing" || p.Extras["request_id"] != "req-1" {
		t.Fatalf("404 problem %+v: want instance and request_id", p)
	}
	ts.do(t, http.MethodGet, "/v1/sub/nothing", "", nil).problem(t, http.StatusNotFound)

	tests := []struct {
		path  string
		allow string
	}{
		{"/v1/items/9", "GET"},
		{"/v1/sub/x", "GET, DELETE"},
	}
	for _, tt := range tests {
		res := ts.do(t, http.MethodPost, tt.path, "{}", nil)
		p := res.problem(t, http.StatusMethodNotAllowed)
		if got := strings.Join(res.header.Values("Allow"), ", "); got != tt.allow {
			t.Errorf("POST %s Allow = %q, want %q", tt.path, got, tt.allow)
		}
		if !strings.Contains(p.Detail, "POST") {
			t.Errorf("405 detail %q does not name the method", p.Detail)
		}
	}
}

func TestPanicBecomesProblemAndServerKeepsServing(t *testing.T) {
	ts := start(t, httpserver.Options{}, func(s *httpserver.Server) {
		s.Router().Get("/boom", func(http.ResponseWriter, *http.Request) { panic("kaboom") })
	})
	p := ts.do(t, http.MethodGet, "/boom", "", nil).problem(t, http.StatusInternalServerError)
	if strings.Contains(p.Detail, "kaboom") {
		t.Errorf("500 detail %q leaks the panic value", p.Detail)
	}
	if res := ts.do(t, http.MethodGet, "/healthz", "", nil); res.status != http.StatusOK {
		t.Fatalf("after panic GET /healthz = %d, want 200", res.status)
	}
	var errorsLogged []map[string]any
	eventually(t, "access log of both requests", func() bool {
		errorsLogged = errorsLogged[:0]
		accessLines := 0
		for _, rec := range ts.logs.Records(t) {
			if rec["level"] == "ERROR" {
				errorsLogged = append(errorsLogged, rec)
			}
			if rec["msg"] == "http request" {
				accessLines++
			}
		}
		return accessLines >= 2
	})
	if len(errorsLogged) != 1 || errorsLogged[0]["panic"] != "kaboom" || errorsLogged[0]["stack"] == "" {
		t.Fatalf("error records %v: want exactly one with the panic value and stack", errorsLogged)
	}
}

// A route behind QuietAccessLog logs its successes at debug and its
// failures at info; another route logs its successes at info.
func TestQuietAccessLog(t *testing.T) {
	ts := start(t, httpserver.Options{}, func(s *httpserver.Server) {
		q := s.Router().With(httpserver.QuietAccessLog)
		q.Get("/quiet/ok", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) })
		q.Get("/quiet/bad", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusBadRequest) })
		s.Router().Get("/loud/ok", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) })
	})
	for _, path := range []string{"/quiet/ok", "/quiet/bad", "/loud/ok"} {
		ts.do(t, http.MethodGet, path, "", nil)
	}
	want := map[string]string{"/quiet/ok": "DEBUG", "/quiet/bad": "INFO", "/loud/ok": "INFO"}
	got := map[string]string{}
	eventually(t, "an access line per request", func() bool {
		for _, rec := range ts.logs.Records(t) {
			if p, ok := rec["path"].(string); ok && rec["msg"] == "http request" {
				got[p], _ = rec["level"].(string)
			}
		}
		return len(got) == len(want)
	})
	for path, level := range want {
		if got[path] != level {
			t.Errorf("access line of %s at %s, want %s", path, got[path], level)
		}
	}
}

func TestTracingNamesSpansByRoute(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	ts := start(t, httpserver.Options{TracerProvider: tp, Propagator: propagation.TraceContext{}}, mountItems)

	const traceID = "4bf92f3577b34da6a3ce929d0e0e4736"
	parent := map[string]string{"traceparent": "00-" + traceID + "-00f067aa0ba902b7-01"}
	ts.do(t, http.MethodGet, "/v1/items/7", "", parent)
	ts.do(t, http.MethodGet, "/healthz", "", nil)

	var spans []sdktrace.ReadOnlySpan
	eventually(t, "the item span", func() bool {
		spans = rec.Ended()
		return len(spans) >= 1
	})
	if len(spans) != 1 {
		t.Fatalf("got %d spans, want 1 (probes are not traced)", len(spans))
	}
	s := spans[0]
	if s.Name() != "GET /v1/items/{id}" || s.SpanContext().TraceID().String() != traceID {
		t.Fatalf("span %q in trace %s, want GET /v1/items/{id} in %s", s.Name(), s.SpanContext().TraceID(), traceID)
	}
	var route string
	for _, kv := range s.Attributes() {
		if kv.Key == "http.route" {
			route = kv.Value.AsString()
		}
	}
	if route != "/v1/items/{id}" {
		t.Fatalf("http.route = %q", route)
	}
	var logged bool
	eventually(t, "access log with trace id", func() bool {
		for _, r := range ts.logs.Records(t) {
			if r["route"] == "/v1/items/{id}" && r["trace_id"] == traceID {
				logged = true
			}
		}
		return logged
	})
}

func TestGracefulShutdownFinishesInFlightRequest(t *testing.T) {
	entered, release := make(chan struct{}), make(chan struct{})
	srv, err := httpserver.New(httpserver.Options{Addr: "127.0.0.1:0", Logger: discardLogger()})
	if err != nil {
		t.Fatal(err)
	}
	srv.Router().Get("/slow", func(w http.ResponseWriter, _ *http.Request) {
		close(entered)
		<-release
		_ = httpserver.WriteJSON(w, http.StatusOK, map[string]string{"status": "done"})
	})
	if err := srv.Listen(); err != nil {
		t.Fatal(err)
	}
	addr := srv.Addr()
	ctx, cancel := context.WithCancel(context.Background())
	runDone := make(chan error, 1)
	go func() { runDone <- srv.Run(ctx) }()

	client := &http.Client{Transport: &http.Transport{}}
	defer client.CloseIdleConnections()
	type result struct {
		status int
		err    error
	}
	got := make(chan result, 1)
	go func() {
		res, err := client.Get("http://" + addr + "/slow")
		if err != nil {
			got <- result{err: err}
			return
		}
		res.Body.Close()
		got <- result{status: res.StatusCode}
	}()
	<-entered
	cancel()
	eventually(t, "the listener to close", func() bool {
		conn, err := net.DialTimeout("tcp", addr, time.Second)
		if err == nil {
			conn.Close()
		}
		return err != nil
	})
	select {
	case err := <-runDone:
		t.Fatalf("Run returned %v while a request was in flight", err)
	default:
	}
	close(release)
	if r := <-got; r.err != nil || r.status != http.StatusOK {
		t.Fatalf("in-flight request = %d, %v; want 200", r.status, r.err)
	}
	if err := <-runDone; err != nil {
		t.Fatalf("Run = %v, want nil", err)
	}
}

func TestShutdownTimeoutIsReported(t *testing.T) {
	entered, release := make(chan struct{}), make(chan struct{})
	defer close(release)
	srv, err := httpserver.New(httpserver.Options{Addr: "127.0.0.1:0", ShutdownTimeout: 20 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	srv.Router().Get("/stuck", func(http.ResponseWriter, *http.Request) {
		close(entered)
		<-release
	})
	if err := srv.Listen(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	runDone := make(chan error, 1)
	go func() { runDone <- srv.Run(ctx) }()
	client := &http.Client{Transport: &http.Transport{}}
	defer client.CloseIdleConnections()
	reqDone := make(chan struct{})
	go func() {
		defer close(reqDone)
		if res, err := client.Get("http://" + srv.Addr() + "/stuck"); err == nil {
			res.Body.Close()
		}
	}()
	<-entered
	cancel()
	if err := <-runDone; !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Run = %v, want a graceful-shutdown deadline error", err)
	}
	release <- struct{}{}
	<-reqDone
}

func TestNewAndRunErrors(t *testing.T) {
	if _, err := httpserver.New(httpserver.Options{}); !errors.Is(err, httpserver.ErrNoAddr) {
		t.Fatalf("New without Addr = %v, want ErrNoAddr", err)
	}
	ts := start(t, httpserver.Options{}, nil)
	// A served request proves the first Run has claimed the server.
	if res := ts.do(t, http.MethodGet, "/healthz", "", nil); res.status != http.StatusOK {
		t.Fatalf("GET /healthz = %d", res.status)
	}
	// Cancelled contexts keep a wrongly successful Run from blocking the test.
	stopped, cancel := context.WithCancel(context.Background())
	cancel()
	if err := ts.Run(stopped); !errors.Is(err, httpserver.ErrRunning) {
		t.Fatalf("second Run = %v, want ErrRunning", err)
	}
	busy, err := httpserver.New(httpserver.Options{Addr: ts.Addr()})
	if err != nil {
		t.Fatal(err)
	}
	if err := busy.Run(stopped); err == nil || !strings.Contains(err.Error(), ts.Addr()) {
		t.Fatalf("Run on a busy port = %v, want a listen error naming the address", err)
	}
}

func TestResponseControllerReachesConnection(t *testing.T) {
	ts := start(t, httpserver.Options{}, func(s *httpserver.Server) {
		s.Router().Get("/stream", func(w http.ResponseWriter, _ *http.Request) {
			rc := http.NewResponseController(w)
			if err := rc.SetWriteDeadline(time.Now().Add(time.Minute)); err != nil {
				http.Error(w, "deadline: "+err.Error(), http.StatusInternalServerError)
				return
			}
			_, _ = w.Write([]byte("part"))
			if err := rc.Flush(); err != nil {
				return
			}
			_, _ = w.Write([]byte("-end"))
		})
	})
	res := ts.do(t, http.MethodGet, "/stream", "", nil)
	if res.status != http.StatusOK || string(res.body) != "part-end" {
		t.Fatalf("GET /stream = %d %q; want 200 part-end (write deadline and flush must reach the connection)", res.status, res.body)
	}
}

func TestCloseReleasesUnstartedListener(t *testing.T) {
	srv, err := httpserver.New(httpserver.Options{Addr: "127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	if err := srv.Listen(); err != nil {
		t.Fatal(err)
	}
	addr := srv.Addr()
	if err := srv.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	again, err := httpserver.New(httpserver.Options{Addr: addr})
	if err != nil {
		t.Fatal(err)
	}
	if err := again.Listen(); err != nil {
		t.Fatalf("Listen on the released address: %v", err)
	}
	if err := again.Close(); err != nil {
		t.Fatal(err)
	}
	stopped, cancel := context.WithCancel(context.Background())
	cancel()
	if err := srv.Run(stopped); !errors.Is(err, httpserver.ErrRunning) {
		t.Fatalf("Run after Close = %v, want ErrRunning", err)
	}
}

// TestShutdownClosesConnectionsWithoutRequests: a connection that never
// sent a request (a client's spare dial) does not hold the shutdown, which
// net/http would otherwise wait on for 5 s, past the shutdown timeout.
func TestShutdownClosesConnectionsWithoutRequests(t *testing.T) {
	srv, err := httpserver.New(httpserver.Options{Addr: "127.0.0.1:0", ShutdownTimeout: time.Second, Logger: discardLogger()})
	if err != nil {
		t.Fatal(err)
	}
	if err := srv.Listen(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	runDone := make(chan error, 1)
	go func() { runDone <- srv.Run(ctx) }()
	silent, err := net.Dial("tcp", srv.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer silent.Close()
	// The server accepts in order: once a later connection is answered,
	// the silent one was accepted (and is in StateNew).
	client := &http.Client{Transport: &http.Transport{}}
	defer client.CloseIdleConnections()
	res, err := client.Get("http://" + srv.Addr() + "/healthz")
	if err != nil {
		t.Fatal(err)
	}
	res.Body.Close()
	cancel()
	if err := <-runDone; err != nil {
		t.Fatalf("Run = %v, want nil: the silent connection held the shutdown", err)
	}
}
