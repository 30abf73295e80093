package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"time"
)

func init() {
	register("probe", "GET a URL and succeed only on a 2xx answer (container health checks)", runProbe)
}

// errProbeFailed reports a probe whose answer was not 2xx.
var errProbeFailed = errors.New("probe failed")

// probeMaxBody bounds how much of a failed answer the probe echoes.
const probeMaxBody = 512

// runProbe GETs one URL within a timeout. It exists because the service
// image has no shell and no curl: compose health checks run
// `kvmesh probe http://127.0.0.1:8081/readyz`.
func runProbe(ctx context.Context, args []string) error {
	target, timeout, err := probeFlags(args)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, target, nil)
	if err != nil {
		return fmt.Errorf("%s: %w", target, err)
	}
	hc := &http.Client{Transport: cliTransport()}
	defer hc.CloseIdleConnections()
	resp, err := hc.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode/100 == 2 {
		return nil
	}
	body, _ := io.ReadAll(io.LimitReader(resp.Body, probeMaxBody))
	return fmt.Errorf("%w: %s answered %s: %s", errProbeFailed, target, resp.Status, body)
}

// probeFlags reads the timeout flag and the one URL argument.
func probeFlags(args []string) (string, time.Duration, error) {
	fs := flag.NewFlagSet("probe", flag.ContinueOnError)
	fs.SetOutput(stderr)
	timeout := fs.Duration("timeout", 3*time.Second, "longest wait for the answer")
	rest, err := parseFlags(fs, args)
	if err != nil {
		return "", 0, err
	}
	if len(rest) != 1 {
		return "", 0, fmt.Errorf("%w: want exactly one URL, got %q", errUsage, rest)
	}
	target := rest[0]
	if u, err := url.Parse(target); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return "", 0, fmt.Errorf("%w: %q is not an http(s) URL", errUsage, target)
	}
	if *timeout <= 0 {
		return "", 0, fmt.Errorf("%w: -timeout %s is not positive", errUsage, *timeout)
	}
	return target, *timeout, nil
}
