package config_test

import (
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/pkg/config"
)

func TestDescribe(t *testing.T) {
	s := settings{
		HTTPAddr:    ":9000",
		DatabaseURL: "postgres://kvmesh:pw@db/kvmesh",
		Timeout:     1500 * time.Millisecond,
		Level:       slog.LevelWarn,
		Kafka:       kafkaSettings{Brokers: []string{"a:1", "b:2"}},
	}
	fields := config.Describe(&s)
	byEnv := make(map[string]config.Field, len(fields))
	for _, f := range fields {
		byEnv[f.Env] = f
	}
	tests := []struct {
		env, value, def, typ string
	}{
		{"T_ADDR", ":9000", ":8082", "string"},
		{"T_DATABASE_URL", config.Masked, "", "string"},
		{"T_TIMEOUT", "1.5s", "5s", "duration"},
		{"T_LEVEL", "WARN", "ERROR", "text"},
		{"T_BROKERS", "a:1,b:2", "127.0.0.1:9092", "list"},
		{"T_WORKERS", "0", "4", "int"},
		{"T_RATIO", "0", "0.5", "float"},
		// A zero default is none.
		{"T_DEBUG", "false", "", "bool"},
	}
	for _, tt := range tests {
		f, ok := byEnv[tt.env]
		if !ok {
			t.Errorf("Describe lacks %s", tt.env)
			continue
		}
		if f.Value != tt.value || f.Default != tt.def || f.Type != tt.typ {
			t.Errorf("%s = {value %q default %q type %q}, want {%q %q %q}",
				tt.env, f.Value, f.Default, f.Type, tt.value, tt.def, tt.typ)
		}
	}
	if len(fields) != 11 {
		t.Errorf("Describe returned %d fields, want 11 (nested flattened, unexported and untagged skipped)", len(fields))
	}
	if !byEnv["T_DATABASE_URL"].Secret || byEnv["T_ADDR"].Secret {
		t.Errorf("Secret flags wrong: %+v", fields)
	}
}

func TestDescribeEmptySecretStaysEmpty(t *testing.T) {
	for _, f := range config.Describe(settings{}) {
		if f.Env == "T_DATABASE_URL" && f.Value != "" {
			t.Fatalf("unset secret described as %q, want empty", f.Value)
		}
	}
}

func TestDescribeNonStruct(t *testing.T) {
	if got := config.Describe(42); got != nil {
		t.Fatalf("Describe(42) = %v, want nil", got)
	}
}

func TestMaskPasswords(t *testing.T) {
	tests := []struct{ in, want string }{
		{"postgres://u:secret@h/db", "postgres://u:***@h/db"},
		{"postgres://u:secret@h:5432/db?sslmode=disable", "postgres://u:***@h:5432/db?sslmode=disable"},
		{"redis://:secret@localhost:6379/0", "redis://:***@localhost:6379/0"},
		{"postgres://u@h/db", "postgres://u@h/db"},
		{"postgres://h/db?user=u&password=secret&sslmode=disable", "postgres://h/db?user=u&password=***&sslmode=disable"},
		{"host=h user=u password=secret dbname=db", "host=h user=u password=*** dbname=db"},
		{"host=h password='two words' dbname=db", "host=h password=*** dbname=db"},
		{"redis://:a@h1:1,redis://:b@h2:2", "redis://:***@h1:1,redis://:***@h2:2"},
		{"http://u:p%zz@h/", "http://u:***@h/"},
		{":8082", ":8082"},
		{"", ""},
	}
	for _, tt := range tests {
		if got := config.MaskPasswords(tt.in); got != tt.want {
			t.Errorf("MaskPasswords(%q) = %q, want %q", tt.in, got, tt.want)
		}
	}
}

func TestDescribeMasksURLPasswordInPlainField(t *testing.T) {
	type plain struct {
		Store string `env:"T_STORE"`
	}
	f := config.Describe(plain{Store: "redis://:hunter2@r:6379"})
	if len(f) != 1 || f[0].Value != "redis://:***@r:6379" {
		t.Fatalf("Describe = %+v, want the URL password masked", f)
	}
}

func TestLogValue(t *testing.T) {
	var b strings.Builder
	logger := slog.New(slog.NewTextHandler(&b, nil))
	logger.Info("config", "config", config.LogValue(settings{DatabaseURL: "postgres://u:pw@h/db", HTTPAddr: ":1"}))
	out := b.String()
	if strings.Contains(out, "pw@") || !strings.Contains(out, "config.T_DATABASE_URL=***") || !strings.Contains(out, "config.T_ADDR=:1") {
		t.Fatalf("logged config %q: want masked secret and plain address", out)
	}
}

func TestMarkdownTable(t *testing.T) {
	want := "| Variable | Type | Default | Description |\n" +
		"|---|---|---|---|\n" +
		"| `T_ADDR` | string | `:8082` | listen address |\n" +
		"| `T_TOKEN` | string |  | admin \\| token. Required. Secret: never logged. |\n"
	if got := config.MarkdownTable(tableDoc{Token: "x"}); got != want {
		t.Fatalf("MarkdownTable:\n%s\nwant:\n%s", got, want)
	}
}

type tableDoc struct {
	Addr  string `env:"T_ADDR" doc:"listen address"`
	Token string `env:"T_TOKEN" secret:"true" required:"true" doc:"admin | token"`
}

func (d *tableDoc) SetDefaults() { d.Addr = ":8082" }

// TestDescribeDurations: durations are written without zero trailing
// units, as an operator writes them.
func TestDescribeDurations(t *testing.T) {
	type durations struct {
		H  time.Duration `env:"T_H"`
		M  time.Duration `env:"T_M"`
		HM time.Duration `env:"T_HM"`
		S  time.Duration `env:"T_S"`
	}
	want := map[string]string{"T_H": "24h", "T_M": "1m", "T_HM": "1h30m", "T_S": "1.5s"}
	for _, f := range config.Describe(durations{H: 24 * time.Hour, M: time.Minute, HM: 90 * time.Minute, S: 1500 * time.Millisecond}) {
		if f.Value != want[f.Env] {
			t.Errorf("%s = %q, want %q", f.Env, f.Value, want[f.Env])
		}
	}
}
