package database

import (
	"context"
	"fmt"
	"regexp"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// Pool defaults applied by Connect unless overridden by an Option.
const (
	DefaultMaxConns          = 10
	DefaultConnectTimeout    = 5 * time.Second
	DefaultHealthCheckPeriod = 30 * time.Second
)

// Option adjusts the pool configuration built by Connect.
type Option func(*pgxpool.Config)

// WithMaxConns sets the maximum number of pooled connections.
func WithMaxConns(n int32) Option {
	return func(c *pgxpool.Config) { c.MaxConns = n }
}

// WithConnectTimeout bounds how long establishing one connection may take.
func WithConnectTimeout(d time.Duration) Option {
	return func(c *pgxpool.Config) { c.ConnConfig.ConnectTimeout = d }
}

// WithHealthCheckPeriod sets how often idle connections are checked.
func WithHealthCheckPeriod(d time.Duration) Option {
	return func(c *pgxpool.Config) { c.HealthCheckPeriod = d }
}

// WithApplicationName sets application_name, shown in pg_stat_activity.
func WithApplicationName(name string) Option {
	return func(c *pgxpool.Config) { c.ConnConfig.RuntimeParams["application_name"] = name }
}

// Connect opens a pgx pool for url (a postgres:// URL or a keyword/value
// string) and pings the server before returning it. Every query, batch and
// COPY made with a context that carries a span gets a client span of its
// own (see queryTracer). Errors never contain the
// password: it is replaced with "***" as in MaskURL.
func Connect(ctx context.Context, url string, opts ...Option) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, maskError(url, fmt.Errorf("database: parse url: %w", err))
	}
	cfg.MaxConns = DefaultMaxConns
	cfg.ConnConfig.ConnectTimeout = DefaultConnectTimeout
	cfg.HealthCheckPeriod = DefaultHealthCheckPeriod
	cfg.ConnConfig.Tracer = queryTracer{}
	for _, opt := range opts {
		opt(cfg)
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, maskError(url, fmt.Errorf("database: open pool for %s: %w", MaskURL(url), err))
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		return nil, maskError(url, fmt.Errorf("database: ping %s: %w", MaskURL(url), err))
	}
	return pool, nil
}

// maskedError replaces an error's text with one scrubbed of a password while
// keeping the cause reachable through errors.Is and errors.As.
type maskedError struct {
	text string
	err  error
}

func (e *maskedError) Error() string { return e.text }
func (e *maskedError) Unwrap() error { return e.err }

// maskError scrubs every password found in url out of err's text.
func maskError(url string, err error) error {
	text := err.Error()
	for _, secret := range passwords(url) {
		text = strings.ReplaceAll(text, secret, "***")
	}
	return &maskedError{text: text, err: err}
}

// MaskURL returns url with any password replaced by "***", for logs and
// errors. It handles postgres:// URLs (user info and a password query
// parameter) and keyword/value strings (password=...); it never fails and
// prefers hiding too much over too little on malformed input.
func MaskURL(url string) string {
	spans := passwordSpans(url)
	var b strings.Builder
	last := 0
	for _, s := range spans {
		b.WriteString(url[last:s[0]])
		b.WriteString("***")
		last = s[1]
	}
	b.WriteString(url[last:])
	return b.String()
}

// passwords returns the non-empty passwords found in url.
func passwords(url string) []string {
	var out []string
	for _, s := range passwordSpans(url) {
		if s[1] > s[0] {
			out = append(out, url[s[0]:s[1]])
		}
	}
	return out
}

var (
	urlScheme     = regexp.MustCompile(`^\s*[a-zA-Z][a-zA-Z0-9+.-]*://`)
	queryPassword = regexp.MustCompile(`[?&]password=([^&#]*)`)
	kvPassword    = regexp.MustCompile(`(?:^|\s)password\s*=\s*('(?:[^'\\]|\\.)*'?|\S*)`)
)

// passwordSpans returns the byte ranges of passwords in url, in order and
// non-overlapping.
func passwordSpans(url string) [][2]int {
	scheme := urlScheme.FindStringIndex(url)
	if scheme == nil {
		return submatchSpans(kvPassword, url, 0)
	}
	rest := scheme[1]
	var spans [][2]int
	if s, ok := userinfoPassword(url[rest:]); ok {
		spans = append(spans, [2]int{rest + s[0], rest + s[1]})
	}
	from := rest
	if len(spans) > 0 {
		from = spans[0][1]
	}
	return append(spans, submatchSpans(queryPassword, url[from:], from)...)
}

// userinfoPassword finds the password in "user:password@host/...": the text
// between the first ':' and the last '@' of the authority. A password holding
// an unescaped '/' makes the authority ambiguous, so the last '@' of the whole
// string is used then.
func userinfoPassword(s string) ([2]int, bool) {
	authority := s
	if slash := strings.IndexByte(s, '/'); slash >= 0 {
		authority = s[:slash]
	}
	at := strings.LastIndexByte(authority, '@')
	if at < 0 {
		at = strings.LastIndexByte(s, '@')
	}
	if at < 0 {
		return [2]int{}, false
	}
	colon := strings.IndexByte(s[:at], ':')
	if colon < 0 {
		return [2]int{}, false
	}
	return [2]int{colon + 1, at}, true
}

// submatchSpans returns the spans of re's first group in s, shifted by offset.
func submatchSpans(re *regexp.Regexp, s string, offset int) [][2]int {
	var spans [][2]int
	for _, m := range re.FindAllStringSubmatchIndex(s, -1) {
		spans = append(spans, [2]int{offset + m[2], offset + m[3]})
	}
	return spans
}
