package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"strings"

	"github.com/kvmesh/kvmesh/internal/devbroker"
	"github.com/kvmesh/kvmesh/pkg/contract"
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
	logger.Info("broker ready", "addr", strings.Join(b.Addrs(), ","), "topics", b.Topics(),
		"partitions", cfg.Partitions, "data_dir", cfg.DataDir)
	<-ctx.Done()
	logger.Info("broker stopping")
	return nil
}

// devbrokerConfig reads the flags, whose defaults come from the environment.
func devbrokerConfig(args []string) (devbroker.Config, error) {
	partitions := devbroker.DefaultPartitions
	if v, ok := os.LookupEnv("KVMESH_BROKER_PARTITIONS"); ok {
		n, err := strconv.Atoi(v)
		if err != nil {
			return devbroker.Config{}, fmt.Errorf("%w: KVMESH_BROKER_PARTITIONS=%q is not an integer", errUsage, v)
		}
		partitions = n
	}
	var cfg devbroker.Config
	fs := flag.NewFlagSet("devbroker", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&cfg.Addr, "addr", envOr("KVMESH_BROKER_ADDR", contract.BrokerAddr),
		"listen address; the host must be loopback, port 0 picks a free port (env KVMESH_BROKER_ADDR)")
	fs.IntVar(&cfg.Partitions, "partitions", partitions, "partitions per topic (env KVMESH_BROKER_PARTITIONS)")
	fs.StringVar(&cfg.DataDir, "data-dir", os.Getenv("KVMESH_BROKER_DATA_DIR"),
		"directory persisting topics, records and offsets; empty keeps them in memory (env KVMESH_BROKER_DATA_DIR)")
	rest, err := parseFlags(fs, args)
	if err != nil {
		return cfg, err
	}
	if len(rest) > 0 {
		return cfg, fmt.Errorf("%w: unexpected arguments %q", errUsage, rest)
	}
	if cfg.Partitions < 1 {
		return cfg, fmt.Errorf("%w: partitions must be at least 1", errUsage)
	}
	return cfg, cfg.Validate()
}

func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}
