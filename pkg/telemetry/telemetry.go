// Package telemetry sets up OpenTelemetry tracing for a kvmesh service, and
// registers Prometheus collectors (RegisterOnce, RegisterAll) and reads them
// back from a /metrics body (ParseExposition, SumSeries).
//
// Setup always installs a tracer provider that gives every request and
// message real trace and span ids that propagate across hops (W3C
// traceparent in HTTP and Kafka headers) and appear in logs. Spans are
// exported over OTLP/HTTP only when an endpoint is configured. Without one
// (and without a span processor or sampler of the caller's) nothing would
// read a span, so the provider gives spans their ids only and records
// nothing: no attributes, events or links are kept (idOnlyProvider). Main reads the
// endpoint from its configuration and passes it in Options, so main stays the
// only reader of the environment.
package telemetry

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"strings"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"
)

// Errors returned by Setup.
var (
	// ErrServiceName means Options.ServiceName was empty.
	ErrServiceName = errors.New("telemetry: service name is required")
	// ErrEndpoint means an OTLP endpoint is not an http(s) URL with a host.
	ErrEndpoint = errors.New("telemetry: invalid OTLP endpoint")
)

// TracesPath is the OTLP/HTTP path appended to Options.OTLPEndpoint.
const TracesPath = "/v1/traces"

// Options configures Setup.
type Options struct {
	// ServiceName becomes the service.name resource attribute. Required.
	ServiceName string
	// Version becomes service.version when set.
	Version string
	// OTLPEndpoint is a base URL such as http://collector:4318, with the
	// meaning of OTEL_EXPORTER_OTLP_ENDPOINT: TracesPath is appended to
	// its path.
	OTLPEndpoint string
	// OTLPTracesEndpoint is a full URL used as is, with the meaning of
	// OTEL_EXPORTER_OTLP_TRACES_ENDPOINT. It wins over OTLPEndpoint.
	OTLPTracesEndpoint string
	// OTLPHeaders are sent with every export (for example an auth token).
	OTLPHeaders map[string]string
	// SpanProcessor, when set, also receives every span (tests attach an
	// in-memory recorder here).
	SpanProcessor sdktrace.SpanProcessor
	// Sampler decides which spans are recorded; default
	// ParentBased(AlwaysSample).
	Sampler sdktrace.Sampler
	// Logger receives errors reported by the OpenTelemetry SDK, such as
	// failed exports; default slog.Default().
	Logger *slog.Logger
}

// Setup installs the global propagator (W3C TraceContext and Baggage) and a
// global tracer provider for the service: an SDK one, exporting over
// OTLP/HTTP with a batch span processor when an endpoint is set, or when
// opts name a span processor or a sampler; otherwise one that only gives
// spans their ids (idOnlyProvider). The returned shutdown flushes
// pending spans and stops the exporter; call it once, before exit.
func Setup(ctx context.Context, opts Options) (shutdown func(context.Context) error, err error) {
	if opts.ServiceName == "" {
		return nil, ErrServiceName
	}
	res, err := newResource(ctx, opts)
	if err != nil {
		return nil, err
	}
	tpOpts := []sdktrace.TracerProviderOption{sdktrace.WithResource(res)}
	if opts.Sampler != nil {
		tpOpts = append(tpOpts, sdktrace.WithSampler(opts.Sampler))
	}
	if opts.SpanProcessor != nil {
		tpOpts = append(tpOpts, sdktrace.WithSpanProcessor(opts.SpanProcessor))
	}
	target, err := tracesURL(opts)
	if err != nil {
		return nil, err
	}
	if target == "" && opts.SpanProcessor == nil && opts.Sampler == nil {
		// Nothing would read a span: give spans their ids only.
		installGlobals(idOnlyProvider{}, opts.Logger)
		return func(context.Context) error { return nil }, nil
	}
	if target != "" {
		exp, err := otlptracehttp.New(ctx, exporterOptions(target, opts.OTLPHeaders)...)
		if err != nil {
			return nil, fmt.Errorf("telemetry: otlp exporter: %w", err)
		}
		tpOpts = append(tpOpts, sdktrace.WithBatcher(exp))
	}
	tp := sdktrace.NewTracerProvider(tpOpts...)
	installGlobals(tp, opts.Logger)
	return func(ctx context.Context) error {
		if err := tp.Shutdown(ctx); err != nil {
			return fmt.Errorf("telemetry: shutdown: %w", err)
		}
		return nil
	}, nil
}

// installGlobals makes tp, the W3C propagators and an error handler that logs
// through logger the process-wide defaults.
func installGlobals(tp trace.TracerProvider, logger *slog.Logger) {
	if logger == nil {
		logger = slog.Default()
	}
	otel.SetTextMapPropagator(propagation.NewCompositeTextMapPropagator(
		propagation.TraceContext{}, propagation.Baggage{}))
	otel.SetTracerProvider(tp)
	otel.SetErrorHandler(otel.ErrorHandlerFunc(func(err error) {
		logger.Warn("opentelemetry error", "err", err)
	}))
}

// newResource describes the service to the trace backend.
func newResource(ctx context.Context, opts Options) (*resource.Resource, error) {
	attrs := []resource.Option{
		resource.WithTelemetrySDK(),
		resource.WithHost(),
		resource.WithSchemaURL(semconv.SchemaURL),
		resource.WithAttributes(semconv.ServiceName(opts.ServiceName)),
	}
	if opts.Version != "" {
		attrs = append(attrs, resource.WithAttributes(semconv.ServiceVersion(opts.Version)))
	}
	res, err := resource.New(ctx, attrs...)
	if err != nil {
		return nil, fmt.Errorf("telemetry: resource: %w", err)
	}
	return res, nil
}

// tracesURL resolves the export URL from the options; "" means no export.
func tracesURL(opts Options) (string, error) {
	raw, base := opts.OTLPTracesEndpoint, false
	if raw == "" {
		raw, base = opts.OTLPEndpoint, true
	}
	if raw == "" {
		return "", nil
	}
	u, err := url.Parse(raw)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return "", fmt.Errorf("%w %q: want http(s)://host:port", ErrEndpoint, raw)
	}
	if base {
		u.Path = strings.TrimSuffix(u.Path, "/") + TracesPath
	}
	return u.String(), nil
}

func exporterOptions(target string, headers map[string]string) []otlptracehttp.Option {
	out := []otlptracehttp.Option{otlptracehttp.WithEndpointURL(target)}
	if len(headers) > 0 {
		out = append(out, otlptracehttp.WithHeaders(headers))
	}
	return out
}
