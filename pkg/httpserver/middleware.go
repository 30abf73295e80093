package httpserver

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"runtime/debug"
	"time"

	"github.com/go-chi/chi/v5"
	"go.opentelemetry.io/contrib/instrumentation/net/http/otelhttp"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
)

// HeaderRequestID carries the request id on requests and responses.
const HeaderRequestID = "X-Request-Id"

// Paths of the built-in routes.
const (
	PathHealth  = "/healthz"
	PathReady   = "/readyz"
	PathMetrics = "/metrics"
)

// routeUnmatched labels requests that matched no route, so unknown paths do
// not create new metric series.
const routeUnmatched = "unmatched"

type ctxKey int

const (
	requestIDKey ctxKey = iota
	bodyKey
	unmatchedKey
	quietKey
)

// markUnmatched records that no route matched the request (404 or 405 from
// the router), so observe labels it routeUnmatched.
func markUnmatched(r *http.Request) {
	if flag, ok := r.Context().Value(unmatchedKey).(*bool); ok {
		*flag = true
	}
}

// QuietAccessLog is route middleware for high-volume routes (a gpuworker's
// data plane: several calls per block batch): their successful requests
// are logged at debug instead of info. A failed one (status 400 and above)
// is logged at info as any other; the metrics count every request.
func QuietAccessLog(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if flag, ok := r.Context().Value(quietKey).(*bool); ok {
			*flag = true
		}
		next.ServeHTTP(w, r)
	})
}

// RequestID returns the request id stored by the server's middleware, or "".
func RequestID(ctx context.Context) string {
	id, _ := ctx.Value(requestIDKey).(string)
	return id
}

// requestID keeps a well-formed incoming X-Request-Id or makes a new one,
// stores it in the context and echoes it on the response.
func requestID(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		id := r.Header.Get(HeaderRequestID)
		if !validRequestID(id) {
			id = newRequestID()
		}
		w.Header().Set(HeaderRequestID, id)
		next.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), requestIDKey, id)))
	})
}

func validRequestID(id string) bool {
	if id == "" || len(id) > 128 {
		return false
	}
	for _, c := range []byte(id) {
		ok := c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' ||
			c == '-' || c == '_' || c == '.' || c == ':'
		if !ok {
			return false
		}
	}
	return true
}

func newRequestID() string {
	var b [12]byte
	_, _ = rand.Read(b[:]) // crypto/rand.Read never fails on supported platforms.
	return hex.EncodeToString(b[:])
}

// isProbe reports whether path is a built-in probe or scrape route.
func isProbe(path string) bool {
	return path == PathHealth || path == PathReady || path == PathMetrics
}

// traceMiddleware starts a server span per request (probes excluded),
// continuing the caller's trace from the W3C headers. observe renames the
// span after the router has matched a route pattern.
func traceMiddleware(opts Options) func(http.Handler) http.Handler {
	otelOpts := []otelhttp.Option{
		otelhttp.WithFilter(func(r *http.Request) bool { return !isProbe(r.URL.Path) }),
		otelhttp.WithSpanNameFormatter(func(_ string, r *http.Request) string { return r.Method }),
	}
	if opts.TracerProvider != nil {
		otelOpts = append(otelOpts, otelhttp.WithTracerProvider(opts.TracerProvider))
	}
	if opts.Propagator != nil {
		otelOpts = append(otelOpts, otelhttp.WithPropagators(opts.Propagator))
	}
	return otelhttp.NewMiddleware(opts.Service, otelOpts...)
}

// observe records the access log line, the request metrics and the span
// name for every request, once the route pattern and status are known.
func observe(logger *slog.Logger, m *httpMetrics) func(http.Handler) http.Handler {
	return func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			start := time.Now()
			sw := &statusWriter{ResponseWriter: w}
			unmatched, quiet := new(bool), new(bool)
			ctx := context.WithValue(r.Context(), unmatchedKey, unmatched)
			r = r.WithContext(context.WithValue(ctx, quietKey, quiet))
			next.ServeHTTP(sw, r)
			elapsed := time.Since(start)

			route := chi.RouteContext(r.Context()).RoutePattern()
			if route == "" || *unmatched {
				route = routeUnmatched
			} else {
				span := trace.SpanFromContext(r.Context())
				span.SetName(r.Method + " " + route)
				span.SetAttributes(attribute.String("http.route", route))
			}
			m.observe(methodLabel(r.Method), route, sw.Status(), elapsed)
			level := slog.LevelInfo
			if isProbe(r.URL.Path) || *quiet && sw.Status() < http.StatusBadRequest {
				level = slog.LevelDebug
			}
			logger.LogAttrs(r.Context(), level, "http request",
				slog.String("method", r.Method),
				slog.String("path", r.URL.Path),
				slog.String("route", route),
				slog.Int("status", sw.Status()),
				slog.Int64("bytes", sw.bytes),
				slog.Float64("duration_ms", float64(elapsed.Microseconds())/1000),
				slog.String("request_id", RequestID(r.Context())),
				slog.String("remote_addr", r.RemoteAddr),
			)
		})
	}
}

// recoverPanic turns a handler panic into a logged error and a 500 problem,
// so one bad request never stops the server. http.ErrAbortHandler is
// re-raised: it is net/http's way to abort a response on purpose.
func recoverPanic(logger *slog.Logger) func(http.Handler) http.Handler {
	return func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			defer func() {
				rec := recover()
				if rec == nil {
					return
				}
				if rec == http.ErrAbortHandler {
					panic(rec)
				}
				logger.ErrorContext(r.Context(), "panic serving request",
					slog.String("method", r.Method),
					slog.String("path", r.URL.Path),
					slog.String("panic", fmt.Sprint(rec)),
					slog.String("stack", string(debug.Stack())),
					slog.String("request_id", RequestID(r.Context())),
				)
				if sw, ok := w.(*statusWriter); ok && sw.status != 0 {
					return // the response has started; the client sees it cut short
				}
				WriteProblem(w, r, http.StatusInternalServerError, "", "the server hit an unexpected error", nil)
			}()
			next.ServeHTTP(w, r)
		})
	}
}

// limitBody caps the request body at limit bytes; reading past it fails
// with *http.MaxBytesError (DecodeJSON answers 413). The original body is
// kept so BodyLimit can set another limit on a route.
func limitBody(limit int64) func(http.Handler) http.Handler {
	return func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			orig := r.Body
			r.Body = http.MaxBytesReader(w, orig, limit)
			next.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), bodyKey, orig)))
		})
	}
}

// BodyLimit replaces the server's body size limit for the routes it wraps
// (for example a data-plane upload larger than Options.MaxBodyBytes); a limit
// of 0 or less removes it.
func BodyLimit(limit int64) func(http.Handler) http.Handler {
	return func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			orig, ok := r.Context().Value(bodyKey).(io.ReadCloser)
			if !ok {
				orig = r.Body
			}
			if limit > 0 {
				r.Body = http.MaxBytesReader(w, orig, limit)
			} else {
				r.Body = orig
			}
			next.ServeHTTP(w, r)
		})
	}
}

// statusWriter records the status and size of a response.
type statusWriter struct {
	http.ResponseWriter
	status int
	bytes  int64
}

// WriteHeader records the final status code.
func (w *statusWriter) WriteHeader(code int) {
	if w.status == 0 && code >= 200 {
		w.status = code
	}
	w.ResponseWriter.WriteHeader(code)
}

// Write records the implicit 200 and the bytes written.
func (w *statusWriter) Write(b []byte) (int, error) {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	n, err := w.ResponseWriter.Write(b)
	w.bytes += int64(n)
	return n, err
}

// Flush sends buffered data to the client, for streaming handlers.
func (w *statusWriter) Flush() {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	_ = http.NewResponseController(w.ResponseWriter).Flush() // Flusher has no error to return.
}

// Unwrap exposes the underlying writer to http.ResponseController.
func (w *statusWriter) Unwrap() http.ResponseWriter {
	return w.ResponseWriter
}

// Status returns the response status; 200 when the handler wrote nothing.
func (w *statusWriter) Status() int {
	if w.status == 0 {
		return http.StatusOK
	}
	return w.status
}

// methodLabel bounds the method label to the standard methods.
func methodLabel(m string) string {
	switch m {
	case http.MethodGet, http.MethodHead, http.MethodPost, http.MethodPut, http.MethodPatch,
		http.MethodDelete, http.MethodOptions, http.MethodConnect, http.MethodTrace:
		return m
	}
	return "OTHER"
}
