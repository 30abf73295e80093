package main

import (
	"flag"
	"os"
	"path/filepath"
	"testing"
)

// TestFlagDefaultsFromServiceSettings: the flags that fall back to the
// services' variables read them through the services' structs: the
// operator token (also from KVMESH_ADMIN_TOKEN_FILE, a secret's file form)
// and the store URL.
func TestFlagDefaultsFromServiceSettings(t *testing.T) {
	quiet(t)
	path := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(path, []byte("file-token\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Setenv("KVMESH_ADMIN_TOKEN", "")
	t.Setenv("KVMESH_ADMIN_TOKEN_FILE", path)
	if o := addClientFlags(flag.NewFlagSet("t", flag.ContinueOnError)); o.token != "file-token" {
		t.Errorf("token %q, want the file's", o.token)
	}
	t.Setenv("KVMESH_ADMIN_TOKEN_FILE", "")
	t.Setenv("KVMESH_ADMIN_TOKEN", "env-token")
	if o := addClientFlags(flag.NewFlagSet("t", flag.ContinueOnError)); o.token != "env-token" {
		t.Errorf("token %q, want KVMESH_ADMIN_TOKEN's", o.token)
	}
	t.Setenv("KVMESH_REDIS_URL", "redis://store:6379/0")
	o, err := simFlags(nil)
	if err != nil {
		t.Fatal(err)
	}
	if o.cfg.RedisURL != "redis://store:6379/0" {
		t.Errorf("store URL %q, want KVMESH_REDIS_URL's", o.cfg.RedisURL)
	}
}

// TestDefaultBrokers: KVMESH_KAFKA_BROKERS wins; unset, the services'
// default broker address unless a .dev/broker.addr is found.
func TestDefaultBrokers(t *testing.T) {
	t.Chdir(t.TempDir())
	t.Setenv("KVMESH_KAFKA_BROKERS", "")
	if got, err := defaultBrokers(); err != nil || got != "127.0.0.1:9092" {
		t.Errorf("defaultBrokers() = %q, %v; want the contract's address", got, err)
	}
	if err := os.MkdirAll(".dev", 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(".dev", "broker.addr"), []byte("127.0.0.1:39092\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if got, err := defaultBrokers(); err != nil || got != "127.0.0.1:39092" {
		t.Errorf("defaultBrokers() = %q, %v; want .dev/broker.addr's", got, err)
	}
	t.Setenv("KVMESH_KAFKA_BROKERS", "a:1, b:2")
	if got, err := defaultBrokers(); err != nil || got != "a:1,b:2" {
		t.Errorf("defaultBrokers() = %q, %v; want KVMESH_KAFKA_BROKERS'", got, err)
	}
}
