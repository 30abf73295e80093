// Command kvmesh is the kvmesh operator CLI. Each subcommand lives in its own
// file and registers itself in commands from an init func:
//
//	kvmesh devbroker [flags]   run the embedded Kafka-protocol broker
//	kvmesh dlq list|show|replay   the sender's dead letters (replay by id or reason, --dry-run)
//	kvmesh outbox failed|retry the outbox rows that could not be published
//	kvmesh requests list|show  the scheduler's request trackers
//	kvmesh workers             the gpuworker registry and each worker's pool
//	kvmesh quota list|get|set|delete   the tenants' quotas in the store (the sender's)
//	kvmesh model               a model's parallel layout: worker ranks, namespaces
//	kvmesh models [--check]    the models a running mesh serves (GET /v1/models); --check: every service serves the same
//	kvmesh status              every service's readiness and key counters
//	kvmesh help                list the subcommands
//
// Subcommands run until they finish or until SIGINT/SIGTERM.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"maps"
	"os"
	"os/signal"
	"slices"
	"syscall"
)

// errUsage reports a command line that names no known subcommand.
var errUsage = errors.New("usage")

// stderr receives logs, usage and errors; tests replace it.
var stderr io.Writer = os.Stderr

// command is one subcommand: a one-line summary and the func that runs it
// with the arguments after its name.
type command struct {
	summary string
	run     func(ctx context.Context, args []string) error
}

// commands maps subcommand names to commands; files add theirs with register.
var commands = map[string]command{}

// register adds a subcommand; it is called from init funcs.
func register(name, summary string, run func(ctx context.Context, args []string) error) {
	commands[name] = command{summary: summary, run: run}
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := exitCode(dispatch(ctx, os.Args[1:]))
	stop()
	os.Exit(code)
}

// dispatch runs the subcommand named by args[0].
func dispatch(ctx context.Context, args []string) error {
	if len(args) == 0 {
		usage()
		return errUsage
	}
	name := args[0]
	switch name {
	case "help", "-h", "-help", "--help":
		usage()
		return nil
	}
	cmd, ok := commands[name]
	if !ok {
		usage()
		return fmt.Errorf("%w: unknown command %q", errUsage, name)
	}
	if err := cmd.run(ctx, args[1:]); err != nil {
		return fmt.Errorf("%s: %w", name, err)
	}
	return nil
}

// exitCode reports err, if any, and maps it to the process exit code: 0 on
// success or -h, 2 for usage errors, 1 otherwise.
func exitCode(err error) int {
	switch {
	case err == nil || errors.Is(err, flag.ErrHelp):
		return 0
	case errors.Is(err, errUsage):
		if err != errUsage {
			fmt.Fprintf(stderr, "kvmesh: %v\n", err)
		}
		return 2
	default:
		fmt.Fprintf(stderr, "kvmesh: %v\n", err)
		return 1
	}
}

func usage() {
	fmt.Fprintln(stderr, "usage: kvmesh <command> [flags]\n\ncommands:")
	for _, name := range slices.Sorted(maps.Keys(commands)) {
		fmt.Fprintf(stderr, "  %-12s %s\n", name, commands[name].summary)
	}
	fmt.Fprintln(stderr, "  help         show this list\n\nRun 'kvmesh <command> -h' for a command's flags.")
}
