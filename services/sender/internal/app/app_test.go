package app_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"strings"
	"testing"

	"go.uber.org/goleak"

	"github.com/kvmesh/kvmesh/internal/servicetest"
	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/config"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/services/sender/internal/app"
)

func TestMain(m *testing.M) {
	code := m.Run()
	if err := testenv.RemoveBinaries(); err != nil {
		fmt.Fprintln(os.Stderr, "remove test binaries:", err)
	}
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			code = 1
		}
	}
	os.Exit(code)
}

// startApp runs the service on a fresh env, its settings loaded the way
// main loads them (defaults for everything the env does not set), and
// waits until it is ready.
func startApp(t *testing.T) *app.App {
	t.Helper()
	return startAppWith(t, nil)
}

// startAppWith is startApp with extra settings.
func startAppWith(t *testing.T, extra map[string]string) *app.App {
	t.Helper()
	env := servicetest.NewEnv(t)
	vars := map[string]string{
		"KVMESH_HTTP_ADDR": "127.0.0.1:0", "KVMESH_DATABASE_URL": env.DatabaseURL, "KVMESH_REDIS_URL": env.RedisURL,
		"KVMESH_KAFKA_BROKERS": strings.Join(env.Brokers, ","), "KVMESH_ADMIN_TOKEN": env.Common().AdminToken,
		"KVMESH_AUTH": "off",
	}
	maps.Copy(vars, extra)
	var cfg app.Config
	if err := config.Load(&cfg, func(k string) (string, bool) { v, ok := vars[k]; return v, ok }); err != nil {
		t.Fatal(err)
	}
	a, err := app.New(context.Background(), cfg, slog.New(slog.DiscardHandler))
	return servicetest.StartReady(t, a, err)
}

func TestStartsReadyAndStops(t *testing.T) {
	startApp(t) // fails unless ready, and unless it stops in time at cleanup
}

func TestREADMEConfig(t *testing.T) {
	servicetest.CheckConfigDoc(t, "sender", &app.Config{})
}

func TestConfigRejectsBadValues(t *testing.T) {
	cases := map[string]string{
		"KVMESH_SENDER_CONSUMERS":      "0",
		"KVMESH_SENDER_CONCURRENCY":    "0",
		"KVMESH_SENDER_RETRY_ATTEMPTS": "0",
		"KVMESH_SENDER_PUT_TIMEOUT":    "-1s",
		"KVMESH_KV_EVENTS_FORM":        "list",
	}
	for name, value := range cases {
		vars := map[string]string{"KVMESH_DATABASE_URL": "postgres://x", "KVMESH_REDIS_URL": "redis://x", name: value}
		var cfg app.Config
		err := config.Load(&cfg, func(k string) (string, bool) { v, ok := vars[k]; return v, ok })
		if err == nil || !strings.Contains(err.Error(), name) {
			t.Errorf("%s=%s: error %v, want one naming the variable", name, value, err)
		}
	}
}

// TestKVEventsFormSetting: KVMESH_KV_EVENTS_FORM (shared with the
// gpuworkers) defaults to map, reads array, and refuses any other value
// with an error that names the setting and the forms it takes, also when
// Validate sees it set directly; the setting's former name,
// KVMESH_SENDER_KV_EVENTS_FORM, is refused whatever its value, naming the
// new one.
func TestKVEventsFormSetting(t *testing.T) {
	load := func(extra map[string]string) (app.Config, error) {
		vars := map[string]string{"KVMESH_DATABASE_URL": "postgres://x", "KVMESH_REDIS_URL": "redis://x", "KVMESH_AUTH": "off"}
		maps.Copy(vars, extra)
		var cfg app.Config
		err := config.Load(&cfg, func(k string) (string, bool) { v, ok := vars[k]; return v, ok })
		return cfg, err
	}
	for value, want := range map[string]contract.KVEventForm{"": contract.KVEventFormMap, "array": contract.KVEventFormArray, "map": contract.KVEventFormMap} {
		if cfg, err := load(map[string]string{"KVMESH_KV_EVENTS_FORM": value}); err != nil || cfg.KVEventsForm != want {
			t.Errorf("KVMESH_KV_EVENTS_FORM=%q: %q, %v; want %q", value, cfg.KVEventsForm, err, want)
		}
	}
	cfg, err := load(map[string]string{"KVMESH_KV_EVENTS_FORM": "json"})
	if err == nil || !strings.Contains(err.Error(), "KVMESH_KV_EVENTS_FORM") || !strings.Contains(err.Error(), "want map or array") {
		t.Errorf("KVMESH_KV_EVENTS_FORM=json: error %v, want one naming the setting and its forms", err)
	}
	cfg.KVEventsForm = "json"
	if err := cfg.Validate(); !errors.Is(err, contract.ErrKVEventForm) || !strings.Contains(err.Error(), "KVMESH_KV_EVENTS_FORM") {
		t.Errorf("Validate with form json: %v", err)
	}
	for _, value := range []string{"array", "map"} {
		_, err := load(map[string]string{"KVMESH_SENDER_KV_EVENTS_FORM": value})
		if !errors.Is(err, config.ErrRenamed) || !strings.Contains(err.Error(), "KVMESH_KV_EVENTS_FORM") {
			t.Errorf("KVMESH_SENDER_KV_EVENTS_FORM=%s: error %v, want config.ErrRenamed naming KVMESH_KV_EVENTS_FORM", value, err)
		}
	}
}
