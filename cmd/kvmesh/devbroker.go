package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"strings"

	"github.com/kvmesh/kvmesh/internal/devbroker"
)

func init() {
	register("devbroker", "run the embedded Kafka-protocol broker (kfake) with every kvmesh topic", runDevbroker)
}

// runDevbroker starts the embedded broker, logs one "broker ready" line and
// serves until ctx ends.
func runDevbroker(ctx context.Context, args []string) error {
	cfg, err := devbrokerConfig(args)
	if err != nil {
		return err
	}
	logger := slog.New(slog.NewJSONHandler(stderr, nil))
	b, err := devbroker.Start(ctx, cfg)
	if err != nil {
		return err
	}
	defer b.Close()
	users := make([]string, len(cfg.SASLUsers)) // mechanism:name, never the password
	for i, u := range cfg.SASLUsers {
		users[i] = u.String()
	}
	logger.Info("broker ready", "addr", strings.Join(b.Addrs(), ","), "topics", b.Topics(),
		"partitions", cfg.Partitions, "data_dir", cfg.DataDir,
		"tls", cfg.TLS.CertFile != "", "mutual_tls", cfg.TLS.CAFile != "", "sasl_users", users)
	<-ctx.Done()
	logger.Info("broker stopping")
	return nil
}

// devbrokerConfig reads the flags, whose defaults come from the environment.
func devbrokerConfig(args []string) (devbroker.Config, error) {
	env, err := loadSettings[brokerSettings]()
	if err != nil {
		return devbroker.Config{}, err
	}
	var cfg devbroker.Config
	fs := flag.NewFlagSet("devbroker", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&cfg.Addr, "addr", env.Addr,
		"listen address; the host must be loopback, port 0 picks a free port (env KVMESH_BROKER_ADDR)")
	fs.IntVar(&cfg.Partitions, "partitions", env.Partitions, "partitions per topic (env KVMESH_BROKER_PARTITIONS)")
	fs.StringVar(&cfg.DataDir, "data-dir", env.DataDir,
		"directory persisting topics, records and offsets; empty keeps them in memory (env KVMESH_BROKER_DATA_DIR)")
	fs.StringVar(&cfg.TLS.CertFile, "tls-cert", env.TLSCert,
		"PEM server certificate: with it (and -tls-key) the broker accepts TLS connections only (env KVMESH_BROKER_TLS_CERT_FILE)")
	fs.StringVar(&cfg.TLS.KeyFile, "tls-key", env.TLSKey,
		"PEM private key of -tls-cert (env KVMESH_BROKER_TLS_KEY_FILE)")
	fs.StringVar(&cfg.TLS.CAFile, "tls-client-ca", env.TLSClientCA,
		"PEM CA bundle: every client must present a certificate it verifies (mutual TLS; needs -tls-cert) (env KVMESH_BROKER_TLS_CLIENT_CA_FILE)")
	users := fs.String("sasl-users", env.SASLUsers,
		"require SASL as one of these users: comma-separated MECHANISM:NAME:PASSWORD, MECHANISM plain, scram-sha-256 or scram-sha-512; "+
			"prefer the env variable, a flag shows in the process list (env KVMESH_BROKER_SASL_USERS)")
	rest, err := parseFlags(fs, args)
	if err != nil {
		return cfg, err
	}
	if len(rest) > 0 {
		return cfg, fmt.Errorf("%w: unexpected arguments %q", errUsage, rest)
	}
	if cfg.SASLUsers, err = devbroker.ParseSASLUsers(*users); err != nil {
		return cfg, fmt.Errorf("%w: -sasl-users: %w", errUsage, err)
	}
	if cfg.Partitions < 1 {
		return cfg, fmt.Errorf("%w: partitions must be at least 1", errUsage)
	}
	return cfg, cfg.Validate()
}
