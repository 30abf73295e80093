package app_test

import (
	"context"
	"log/slog"
	"reflect"
	"strings"
	"testing"

	"go.uber.org/goleak"

	"github.com/kvmesh/kvmesh/internal/servicetest"
	"github.com/kvmesh/kvmesh/pkg/config"
	"github.com/kvmesh/kvmesh/pkg/service"
	"github.com/kvmesh/kvmesh/services/lookup/internal/app"
)

// TestMain checks for leaked goroutines, less the one go-zeromq/zmq4
// v0.17.0 leaves per PUB socket (its Close never ends the writer NewPub
// started; see package kvpublish).
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*pubMWriter).run"))
}

// startApp runs the service on a fresh env and waits until it is ready.
func startApp(t *testing.T) *app.App {
	t.Helper()
	env := servicetest.NewEnv(t)
	cfg := app.Config{Common: env.Common(), HTTP: service.HTTP{HTTPAddr: "127.0.0.1:0"}, Store: service.Store{RedisURL: env.RedisURL}, Enabled: true}
	cfg.KeyPrefix = randomID("openapi-")
	a, err := app.New(context.Background(), cfg, slog.New(slog.DiscardHandler))
	return servicetest.StartReady(t, a, err)
}

func TestStartsReadyAndStops(t *testing.T) {
	startApp(t) // fails unless ready, and unless it stops in time at cleanup
}

func TestREADMEConfig(t *testing.T) {
	servicetest.CheckConfigDoc(t, "lookup", &app.Config{})
}

func TestConfigValidation(t *testing.T) {
	base := map[string]string{"KVMESH_REDIS_URL": "redis://127.0.0.1:1/0", "KVMESH_AUTH": "off"}
	cases := []struct {
		name string
		vars map[string]string
		want string // "" for a valid configuration
	}{
		{"defaults", nil, ""},
		{"pd then store", map[string]string{"KVMESH_LOOKUP_CONNECTORS": "pd, store"}, ""},
		{"unknown connector", map[string]string{"KVMESH_LOOKUP_CONNECTORS": "pd,lmcache"}, "KVMESH_LOOKUP_CONNECTORS"},
		{"connector twice", map[string]string{"KVMESH_LOOKUP_CONNECTORS": "store,store"}, "KVMESH_LOOKUP_CONNECTORS"},
		{"prefix with @", map[string]string{"KVMESH_KEY_PREFIX": "dep@A"}, "KVMESH_KEY_PREFIX"},
		{"bad bool", map[string]string{"KVMESH_LOOKUP_ENABLED": "maybe"}, "KVMESH_LOOKUP_ENABLED"},
		{"negative timeout", map[string]string{"KVMESH_LOOKUP_TIMEOUT": "-1s"}, "KVMESH_LOOKUP_TIMEOUT"},
		{"shared settings still checked", map[string]string{"KVMESH_KAFKA_PARTITIONS": "0"}, "KVMESH_KAFKA_PARTITIONS"},
		{"kv events publisher", map[string]string{"KVMESH_LOOKUP_KV_EVENTS_ZMQ_ENDPOINT": "tcp://*:5557", "KVMESH_LOOKUP_KV_EVENTS_ZMQ_REPLAY_ENDPOINT": "tcp://*:5558", "KVMESH_LOOKUP_KV_EVENTS_ZMQ_FORM": "array", "KVMESH_LOOKUP_KV_EVENTS_ZMQ_TENANT": "acme", "KVMESH_LOOKUP_KV_EVENTS_ZMQ_REPLAY_FRAMING": "seq"}, ""},
		{"kv events form", map[string]string{"KVMESH_LOOKUP_KV_EVENTS_ZMQ_FORM": "list"}, "KVMESH_LOOKUP_KV_EVENTS_ZMQ_FORM"},
		{"kv events framing", map[string]string{"KVMESH_LOOKUP_KV_EVENTS_ZMQ_REPLAY_FRAMING": "frames"}, "KVMESH_LOOKUP_KV_EVENTS_ZMQ_REPLAY_FRAMING"},
		{"kv events tenant", map[string]string{"KVMESH_LOOKUP_KV_EVENTS_ZMQ_TENANT": "a b"}, "KVMESH_LOOKUP_KV_EVENTS_ZMQ_TENANT"},
		{"kv events buffer", map[string]string{"KVMESH_LOOKUP_KV_EVENTS_ZMQ_BUFFER_STEPS": "-1"}, "KVMESH_LOOKUP_KV_EVENTS_ZMQ_BUFFER_STEPS"},
		{"replay without publisher", map[string]string{"KVMESH_LOOKUP_KV_EVENTS_ZMQ_REPLAY_ENDPOINT": "tcp://*:5558"}, "KVMESH_LOOKUP_KV_EVENTS_ZMQ_REPLAY_ENDPOINT"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			vars := map[string]string{}
			for k, v := range base {
				vars[k] = v
			}
			for k, v := range tc.vars {
				vars[k] = v
			}
			var cfg app.Config
			err := config.Load(&cfg, func(k string) (string, bool) { v, ok := vars[k]; return v, ok })
			switch {
			case tc.want == "" && err != nil:
				t.Fatalf("Load: %v", err)
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Fatalf("Load = %v, want an error naming %s", err, tc.want)
			}
		})
	}
	var cfg app.Config
	if err := config.Load(&cfg, func(k string) (string, bool) { v, ok := base[k]; return v, ok }); err != nil {
		t.Fatal(err)
	}
	if !cfg.Enabled || !cfg.LoadAsync || !reflect.DeepEqual(cfg.Connectors, []string{"store"}) || cfg.KeyPrefix != "" {
		t.Errorf("defaults: enabled %v load_async %v connectors %q prefix %q; want true, true, [store], empty",
			cfg.Enabled, cfg.LoadAsync, cfg.Connectors, cfg.KeyPrefix)
	}
	if cfg.KVEventsZMQEndpoint != "" || cfg.KVEventsZMQPod != "kvmesh-store" || cfg.KVEventsZMQForm != "map" ||
		cfg.KVEventsZMQBufferSteps != 10000 || cfg.KVEventsZMQReplayFraming != "topic" || cfg.KVEventsZMQTenant != "" {
		t.Errorf("kv events publisher defaults: endpoint %q pod %q form %q buffer %d framing %q tenant %q; want off, kvmesh-store, map, 10000, topic, tenant-less",
			cfg.KVEventsZMQEndpoint, cfg.KVEventsZMQPod, cfg.KVEventsZMQForm, cfg.KVEventsZMQBufferSteps, cfg.KVEventsZMQReplayFraming, cfg.KVEventsZMQTenant)
	}
}
