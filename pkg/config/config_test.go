package config_test

import (
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/pkg/config"
)

type kafkaSettings struct {
	Brokers []string `env:"T_BROKERS" doc:"Kafka brokers"`
	GroupID string   `env:"T_GROUP"`
}

func (k *kafkaSettings) SetDefaults() {
	k.Brokers = []string{"127.0.0.1:9092"}
	k.GroupID = "kvmesh-test"
}

type settings struct {
	HTTPAddr    string        `env:"T_ADDR" doc:"listen address"`
	DatabaseURL string        `env:"T_DATABASE_URL" secret:"true" doc:"PostgreSQL URL"`
	Debug       bool          `env:"T_DEBUG"`
	Workers     int           `env:"T_WORKERS"`
	MaxBytes    int64         `env:"T_MAX_BYTES"`
	Small       int8          `env:"T_SMALL"`
	Ratio       float64       `env:"T_RATIO"`
	Timeout     time.Duration `env:"T_TIMEOUT"`
	Level       slog.Level    `env:"T_LEVEL"`
	Kafka       kafkaSettings
	hidden      string `env:"T_HIDDEN"`
	Ignored     string
}

func (s *settings) SetDefaults() {
	s.HTTPAddr = ":8082"
	s.Workers = 4
	s.MaxBytes = 1048576
	s.Ratio = 0.5
	s.Timeout = 5 * time.Second
	s.Level = slog.LevelError
}

func lookupFrom(m map[string]string) func(string) (string, bool) {
	return func(k string) (string, bool) {
		v, ok := m[k]
		return v, ok
	}
}

func TestLoadDefaults(t *testing.T) {
	var got settings
	if err := config.Load(&got, lookupFrom(nil)); err != nil {
		t.Fatalf("Load: %v", err)
	}
	want := settings{
		HTTPAddr: ":8082", Workers: 4, MaxBytes: 1 << 20, Ratio: 0.5,
		Timeout: 5 * time.Second, Level: slog.LevelError,
		Kafka: kafkaSettings{Brokers: []string{"127.0.0.1:9092"}, GroupID: "kvmesh-test"},
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("Load defaults:\n got %+v\nwant %+v", got, want)
	}
}

func TestLoadValues(t *testing.T) {
	env := map[string]string{
		"T_ADDR":         "127.0.0.1:0",
		"T_DATABASE_URL": "postgres://kvmesh:pw@localhost/kvmesh",
		"T_DEBUG":        "true",
		"T_WORKERS":      "16",
		"T_MAX_BYTES":    "9000000000",
		"T_SMALL":        "-7",
		"T_RATIO":        "0.25",
		"T_TIMEOUT":      "250ms",
		"T_LEVEL":        "debug",
		"T_BROKERS":      " a:9092, b:9092 ,,",
		"T_GROUP":        "",
		"T_HIDDEN":       "must not be set",
	}
	var got settings
	if err := config.Load(&got, lookupFrom(env)); err != nil {
		t.Fatalf("Load: %v", err)
	}
	want := settings{
		HTTPAddr: "127.0.0.1:0", DatabaseURL: "postgres://kvmesh:pw@localhost/kvmesh",
		Debug: true, Workers: 16, MaxBytes: 9000000000, Small: -7, Ratio: 0.25,
		Timeout: 250 * time.Millisecond, Level: slog.LevelDebug,
		// An empty T_GROUP counts as unset, so the default applies.
		Kafka: kafkaSettings{Brokers: []string{"a:9092", "b:9092"}, GroupID: "kvmesh-test"},
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("Load:\n got %+v\nwant %+v", got, want)
	}
}

func TestLoadErrors(t *testing.T) {
	tests := []struct {
		name     string
		env      map[string]string
		wantErr  error
		contains []string
		hides    string
	}{
		{"bad duration", map[string]string{"T_TIMEOUT": "5x"}, config.ErrInvalidValue,
			[]string{"T_TIMEOUT", `"5x"`, "duration"}, ""},
		{"bad int", map[string]string{"T_WORKERS": "four"}, config.ErrInvalidValue,
			[]string{"T_WORKERS", `"four"`, "integer"}, ""},
		{"int overflow", map[string]string{"T_SMALL": "300"}, config.ErrInvalidValue,
			[]string{"T_SMALL", `"300"`, "8-bit"}, ""},
		{"bad bool", map[string]string{"T_DEBUG": "yes please"}, config.ErrInvalidValue,
			[]string{"T_DEBUG", "true or false"}, ""},
		{"bad float", map[string]string{"T_RATIO": "half"}, config.ErrInvalidValue,
			[]string{"T_RATIO", `"half"`, "number"}, ""},
		{"bad text", map[string]string{"T_LEVEL": "loud"}, config.ErrInvalidValue,
			[]string{"T_LEVEL", `"loud"`}, ""},
		{"two bad values both reported", map[string]string{"T_WORKERS": "x", "T_RATIO": "y"},
			config.ErrInvalidValue, []string{"T_WORKERS", "T_RATIO"}, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var s settings
			err := config.Load(&s, lookupFrom(tt.env))
			if !errors.Is(err, tt.wantErr) {
				t.Fatalf("Load error = %v, want %v", err, tt.wantErr)
			}
			for _, c := range tt.contains {
				if !strings.Contains(err.Error(), c) {
					t.Errorf("error %q does not mention %q", err, c)
				}
			}
		})
	}
}

type secretNumber struct {
	Port int `env:"T_PORT" secret:"true"`
}

func TestLoadErrorHidesSecretValue(t *testing.T) {
	var s secretNumber
	err := config.Load(&s, lookupFrom(map[string]string{"T_PORT": "hunter2"}))
	if !errors.Is(err, config.ErrInvalidValue) {
		t.Fatalf("Load error = %v, want ErrInvalidValue", err)
	}
	if strings.Contains(err.Error(), "hunter2") || !strings.Contains(err.Error(), "T_PORT") {
		t.Fatalf("error %q must name T_PORT and hide its value", err)
	}
}

type required struct {
	URL string `env:"T_URL" required:"true" doc:"store URL"`
}

func TestLoadRequired(t *testing.T) {
	var r required
	err := config.Load(&r, lookupFrom(map[string]string{"T_URL": ""}))
	if !errors.Is(err, config.ErrMissing) || !strings.Contains(err.Error(), "T_URL") {
		t.Fatalf("Load error = %v, want ErrMissing naming T_URL", err)
	}
	if err := config.Load(&r, lookupFrom(map[string]string{"T_URL": "redis://x"})); err != nil {
		t.Fatalf("Load with value: %v", err)
	}
}

type unsupported struct {
	Ptr *string `env:"T_PTR"`
}

func TestLoadRejectsProgrammingErrors(t *testing.T) {
	tests := []struct {
		name    string
		dst     any
		env     map[string]string
		wantErr error
		mention string
	}{
		{"not a pointer", settings{}, nil, config.ErrNotStructPointer, ""},
		{"nil pointer", (*settings)(nil), nil, config.ErrNotStructPointer, ""},
		{"pointer to non-struct", new(int), nil, config.ErrNotStructPointer, ""},
		{"unsupported field type", &unsupported{}, map[string]string{"T_PTR": "x"}, config.ErrUnsupportedType, "T_PTR"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := config.Load(tt.dst, lookupFrom(tt.env))
			if !errors.Is(err, tt.wantErr) {
				t.Fatalf("Load error = %v, want %v", err, tt.wantErr)
			}
			if !strings.Contains(err.Error(), tt.mention) {
				t.Fatalf("error %q does not mention %q", err, tt.mention)
			}
		})
	}
}

var errTooFewWorkers = errors.New("need at least 2 workers")

type validated struct {
	Workers int `env:"T_WORKERS"`
}

func (v *validated) SetDefaults() { v.Workers = 2 }

func (v *validated) Validate() error {
	if v.Workers < 2 {
		return errTooFewWorkers
	}
	return nil
}

func TestLoadCallsValidator(t *testing.T) {
	var v validated
	if err := config.Load(&v, lookupFrom(nil)); err != nil {
		t.Fatalf("Load valid: %v", err)
	}
	err := config.Load(&v, lookupFrom(map[string]string{"T_WORKERS": "1"}))
	if !errors.Is(err, errTooFewWorkers) {
		t.Fatalf("Load error = %v, want the validator's error", err)
	}
}

// TestLoadSecretFromFile: a secret's NAME_FILE gives its value (trailing
// newline trimmed); both set, or an unreadable file, is an error that does
// not show the secret.
func TestLoadSecretFromFile(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "db-url")
	if err := os.WriteFile(path, []byte("postgres://u:hunter2@db/x\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	var s settings
	if err := config.Load(&s, lookupFrom(map[string]string{"T_DATABASE_URL_FILE": path})); err != nil {
		t.Fatalf("Load: %v", err)
	}
	if s.DatabaseURL != "postgres://u:hunter2@db/x" {
		t.Fatalf("DatabaseURL = %q, want the file's content without its newline", s.DatabaseURL)
	}
	for name, env := range map[string]map[string]string{
		"both set":     {"T_DATABASE_URL": "postgres://other", "T_DATABASE_URL_FILE": path},
		"missing file": {"T_DATABASE_URL_FILE": filepath.Join(dir, "nope")},
	} {
		err := config.Load(&s, lookupFrom(env))
		if !errors.Is(err, config.ErrSecretFile) || strings.Contains(err.Error(), "hunter2") {
			t.Errorf("%s: Load error = %v, want ErrSecretFile without the secret", name, err)
		}
	}
	// A setting that is not secret has no _FILE form.
	if err := config.Load(&s, lookupFrom(map[string]string{"T_ADDR_FILE": path})); err != nil || s.HTTPAddr != ":8082" {
		t.Fatalf("T_ADDR_FILE: err %v, HTTPAddr %q; want it ignored", err, s.HTTPAddr)
	}
}
