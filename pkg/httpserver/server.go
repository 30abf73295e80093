// Package httpserver is the HTTP front of every kvmesh service: a chi router
// with the common middleware (request ids, panic recovery, access log,
// OpenTelemetry spans, Prometheus metrics, body size limit), the built-in
// routes GET /healthz, /readyz and /metrics, RFC 9457 problem responses,
// strict JSON decoding and bearer-token protection for admin routes.
//
// A service builds a Server, mounts its routes on Router() and calls Run:
//
//	srv, err := httpserver.New(httpserver.Options{Addr: cfg.HTTPAddr, Service: "sender", Logger: logger})
//	srv.Router().Get("/v1/dlq", listDLQ)
//	srv.Router().With(srv.RequireAdmin()).Post("/v1/dlq/{id}/replay", replay)
//	err = srv.Run(ctx) // returns nil after a graceful stop when ctx is cancelled
package httpserver

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvmesh/kvmesh/pkg/auth"
)

// Defaults applied by New to zero Options fields.
const (
	DefaultMaxBodyBytes      int64 = 1 << 20
	DefaultReadHeaderTimeout       = 5 * time.Second
	DefaultReadTimeout             = 30 * time.Second
	DefaultWriteTimeout            = 30 * time.Second
	DefaultIdleTimeout             = 120 * time.Second
	DefaultShutdownTimeout         = 5 * time.Second
	DefaultReadyTimeout            = 2 * time.Second
)

// Errors returned by New, Listen and Run.
var (
	// ErrNoAddr means Options.Addr was empty.
	ErrNoAddr = errors.New("httpserver: listen address is required")
	// ErrRunning means Run was called on a server that is already running,
	// has stopped or was closed.
	ErrRunning = errors.New("httpserver: server already started or closed")
)

// ReadyCheck is one dependency probed by GET /readyz.
type ReadyCheck struct {
	// Name identifies the dependency in the readiness report.
	Name string
	// Check returns nil when the dependency is usable. Its context ends
	// after Options.ReadyTimeout.
	Check func(ctx context.Context) error
	// Optional marks a dependency the service keeps serving without,
	// degraded (the lookup's store: its store child fails open). Its
	// failure is reported in the /readyz body (checks, and the degraded
	// list) but does not make the service unready.
	Optional bool
}

// Options configures a Server. Zero fields take the documented defaults.
type Options struct {
	// Addr is the listen address, such as ":8082" or "127.0.0.1:0".
	Addr string
	// Service names the service in logs, spans and /healthz.
	Service string
	// Logger receives the access log and panic reports; default discards.
	Logger *slog.Logger
	// Ready lists the checks behind GET /readyz.
	Ready []ReadyCheck
	// Registry is served on GET /metrics and receives the HTTP metrics and
	// the Go and process collectors; default a new registry.
	Registry *prometheus.Registry
	// AdminToken guards routes wrapped with Server.RequireAdmin.
	AdminToken string
	// Auth verifies the credentials of every route the OpenAPI document
	// (ServeOpenAPI) does not make public; nil authenticates nothing but
	// the routes wrapped with RequireAdmin.
	Auth *auth.Verifier
	// EngineID, when set, is the engine this service serves (a
	// gpuworker's): engine credentials of other engines are refused.
	EngineID string
	// TLS, when set, serves HTTPS with this configuration (tlsfiles).
	TLS *tls.Config
	// MaxBodyBytes limits request bodies; default DefaultMaxBodyBytes.
	MaxBodyBytes int64
	// ReadHeaderTimeout sets http.Server.ReadHeaderTimeout; default
	// DefaultReadHeaderTimeout.
	ReadHeaderTimeout time.Duration
	// ReadTimeout sets http.Server.ReadTimeout; default DefaultReadTimeout.
	ReadTimeout time.Duration
	// WriteTimeout sets http.Server.WriteTimeout; default
	// DefaultWriteTimeout. A long streaming handler can extend its own
	// deadline with http.NewResponseController(w).SetWriteDeadline.
	WriteTimeout time.Duration
	// IdleTimeout sets http.Server.IdleTimeout; default DefaultIdleTimeout.
	IdleTimeout time.Duration
	// ShutdownTimeout bounds the graceful stop in Run; default
	// DefaultShutdownTimeout.
	ShutdownTimeout time.Duration
	// ReadyTimeout bounds each readiness check; default DefaultReadyTimeout.
	ReadyTimeout time.Duration
	// TracerProvider creates the server spans; default the global provider.
	TracerProvider trace.TracerProvider
	// Propagator reads trace context from request headers; default the
	// global propagator.
	Propagator propagation.TextMapPropagator
}

// withDefaults fills zero fields.
func (o Options) withDefaults() Options {
	if o.Service == "" {
		o.Service = "kvmesh"
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	if o.Registry == nil {
		o.Registry = prometheus.NewRegistry()
	}
	setDefault(&o.MaxBodyBytes, DefaultMaxBodyBytes)
	setDefault(&o.ReadHeaderTimeout, DefaultReadHeaderTimeout)
	setDefault(&o.ReadTimeout, DefaultReadTimeout)
	setDefault(&o.WriteTimeout, DefaultWriteTimeout)
	setDefault(&o.IdleTimeout, DefaultIdleTimeout)
	setDefault(&o.ShutdownTimeout, DefaultShutdownTimeout)
	setDefault(&o.ReadyTimeout, DefaultReadyTimeout)
	return o
}

func setDefault[T int64 | time.Duration](v *T, def T) {
	if *v <= 0 {
		*v = def
	}
}

// Server is one service's HTTP server.
type Server struct {
	opts    Options
	mux     *chi.Mux
	http    *http.Server
	builtin sync.Once
	fresh   freshConns
	access  access

	mu      sync.Mutex
	ln      net.Listener
	started bool
}

// New builds a Server with the common middleware installed. It does not
// listen yet: call Listen to learn the bound address early, or Run.
func New(opts Options) (*Server, error) {
	if opts.Addr == "" {
		return nil, ErrNoAddr
	}
	opts = opts.withDefaults()
	m, err := newHTTPMetrics(opts.Registry)
	if err != nil {
		return nil, err
	}
	s := &Server{opts: opts, mux: chi.NewRouter()}
	s.mux.Use(
		requestID,
		traceMiddleware(opts),
		observe(opts.Logger, m),
		recoverPanic(opts.Logger),
		limitBody(opts.MaxBodyBytes),
	)
	s.mux.Use(s.authorize)
	s.mux.NotFound(notFound)
	s.mux.MethodNotAllowed(s.methodNotAllowed)
	s.http = &http.Server{
		Handler:           s.mux,
		ReadHeaderTimeout: opts.ReadHeaderTimeout,
		ReadTimeout:       opts.ReadTimeout,
		WriteTimeout:      opts.WriteTimeout,
		IdleTimeout:       opts.IdleTimeout,
		ErrorLog:          slog.NewLogLogger(opts.Logger.Handler(), slog.LevelWarn),
		ConnState:         s.fresh.track,
		TLSConfig:         opts.TLS,
	}
	s.http.RegisterOnShutdown(s.fresh.closeAll)
	return s, nil
}

// freshConns tracks the connections that have not sent a request yet.
// net/http's Shutdown waits for such a connection for 5 s before it counts
// as idle — longer than a service's shutdown timeout — and an HTTP client
// opens one whenever a dial it started is overtaken by an idle connection
// of its pool. They hold no request, so shutdown closes them at once
// (registered with RegisterOnShutdown, which runs once the listeners are
// closed); a request arriving on one at that moment gets the connection
// closed, as it would on a listener that stopped.
type freshConns struct {
	mu    sync.Mutex
	conns map[net.Conn]struct{}
}

// track is the http.Server's ConnState hook.
func (f *freshConns) track(c net.Conn, state http.ConnState) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if state == http.StateNew {
		if f.conns == nil {
			f.conns = map[net.Conn]struct{}{}
		}
		f.conns[c] = struct{}{}
		return
	}
	delete(f.conns, c)
}

// closeAll closes every connection that has not sent a request yet.
func (f *freshConns) closeAll() {
	f.mu.Lock()
	defer f.mu.Unlock()
	for c := range f.conns {
		_ = c.Close()
		delete(f.conns, c)
	}
}

// Router returns the router on which the service mounts its routes. More
// middleware may be added with Use before the first route is mounted.
func (s *Server) Router() chi.Router {
	return s.mux
}

// RequireAdmin returns RequireAdmin(Options.AdminToken).
func (s *Server) RequireAdmin() func(http.Handler) http.Handler {
	return RequireAdmin(s.opts.AdminToken)
}

// Handler returns the complete handler, built-in routes included, for use
// with httptest or another server. Mount service routes before calling it.
func (s *Server) Handler() http.Handler {
	s.builtin.Do(s.mountBuiltin)
	return s.mux
}

// Listen binds the listen address, if not already bound. With port 0 the
// kernel picks a free port; Addr then reports it.
func (s *Server) Listen() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ln != nil {
		return nil
	}
	if s.started {
		return ErrRunning
	}
	ln, err := net.Listen("tcp", s.opts.Addr)
	if err != nil {
		return fmt.Errorf("httpserver: listen %s: %w", s.opts.Addr, err)
	}
	s.ln = ln
	return nil
}

// Addr returns the bound address (host:port) once listening, otherwise the
// configured address.
func (s *Server) Addr() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ln != nil {
		return s.ln.Addr().String()
	}
	return s.opts.Addr
}

// Close releases the listener of a server that Listen bound but Run never
// started (for example when a later start-up step failed); Run then returns
// ErrRunning. Once Run has started it owns the listener and Close does
// nothing: cancel Run's context to stop the server.
func (s *Server) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.started {
		return nil
	}
	s.started = true
	if s.ln == nil {
		return nil
	}
	if err := s.ln.Close(); err != nil {
		return fmt.Errorf("httpserver: close listener: %w", err)
	}
	return nil
}

// Run listens (unless Listen was called) and serves until ctx is cancelled,
// then stops gracefully: the listener closes, in-flight requests finish
// within ShutdownTimeout, and Run returns nil. It returns an error when
// serving fails or the graceful stop runs out of time (remaining
// connections are then closed).
func (s *Server) Run(ctx context.Context) error {
	if err := s.Listen(); err != nil {
		return err
	}
	ln, err := s.claim()
	if err != nil {
		return err
	}
	if s.opts.Auth != nil && s.access.err != nil {
		_ = ln.Close()
		return s.access.err
	}
	if s.opts.TLS != nil {
		ln = tls.NewListener(ln, s.opts.TLS)
	}
	s.Handler()
	s.http.BaseContext = func(net.Listener) context.Context { return context.WithoutCancel(ctx) }
	serveErr := make(chan error, 1)
	go func() { serveErr <- s.http.Serve(ln) }()
	s.opts.Logger.InfoContext(ctx, "http server listening", "addr", ln.Addr().String())

	select {
	case err := <-serveErr:
		return fmt.Errorf("httpserver: serve: %w", err)
	case <-ctx.Done():
	}
	return s.shutdown(ctx, serveErr)
}

// claim marks the server started and returns its listener.
func (s *Server) claim() (net.Listener, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.started {
		return nil, ErrRunning
	}
	s.started = true
	return s.ln, nil
}

// shutdown stops the server gracefully within ShutdownTimeout.
func (s *Server) shutdown(ctx context.Context, serveErr <-chan error) error {
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), s.opts.ShutdownTimeout)
	defer cancel()
	err := s.http.Shutdown(sctx)
	if err != nil {
		closeErr := s.http.Close()
		<-serveErr
		return fmt.Errorf("httpserver: graceful shutdown: %w", errors.Join(err, closeErr))
	}
	if err := <-serveErr; err != nil && !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("httpserver: serve: %w", err)
	}
	return nil
}
