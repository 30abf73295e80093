package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/kvmesh/kvmesh/internal/sim"
	"github.com/kvmesh/kvmesh/pkg/auth"
	"github.com/kvmesh/kvmesh/pkg/config"
	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/service"
)

func init() {
	register("token", "mint an engine token (or a service token) signed with KVMESH_AUTH_KEY: token --engine ID [--tenant T,...] [--ttl 24h]", runToken)
}

// authSettings are the credentials the CLI reads from the environment:
// the auth key (KVMESH_AUTH_KEY or KVMESH_AUTH_KEY_FILE) and the operator
// token, with the services' rules.
type authSettings struct {
	Auth auth.Config
	// Admin is the operator token, declared where the services read it.
	service.Admin
}

// loadAuth reads authSettings from the environment.
func loadAuth() (authSettings, error) {
	var s authSettings
	if err := config.Load(&s, os.LookupEnv); err != nil {
		return s, err
	}
	return s, s.Auth.Validate()
}

// runToken mints one token and prints it on stdout.
func runToken(_ context.Context, args []string) error {
	fs := flag.NewFlagSet("token", flag.ContinueOnError)
	fs.SetOutput(stderr)
	engine := fs.String("engine", "", "the engine id the token names (an engine token)")
	svc := fs.String("service", "", "the service name the token names (a service token), instead of --engine")
	tenants := fs.String("tenant", "", "comma-separated tenants the engine serves ('*' for every tenant; none: only the default tenant)")
	ttl := fs.Duration("ttl", 24*time.Hour, "how long the token is valid")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return fmt.Errorf("%w: %w", errUsage, err)
	}
	kind, subject := auth.KindEngine, *engine
	switch {
	case *engine != "" && *svc != "", *engine == "" && *svc == "":
		return fmt.Errorf("%w: give one of --engine or --service", errUsage)
	case *svc != "":
		kind, subject = auth.KindService, *svc
	}
	var ts []string
	for _, t := range strings.Split(*tenants, ",") {
		if t = strings.TrimSpace(t); t != "" {
			ts = append(ts, t)
		}
	}
	s, err := loadAuth()
	if err != nil {
		return err
	}
	if !s.Auth.Required() {
		return errors.New("KVMESH_AUTH=off: there is no auth key to sign with")
	}
	k, err := auth.NewKey(s.Auth.Key)
	if err != nil {
		return err
	}
	tok, err := k.Mint(kind, subject, ts, *ttl)
	if err != nil {
		return err
	}
	_, err = fmt.Fprintln(stdout, tok)
	return err
}

// simCredentials are the credentials `kvmesh sim` presents: engine tokens
// it mints with the auth key when authentication is on, and the operator
// token when set; nil when there is neither.
func simCredentials() (*sim.Credentials, error) {
	s, err := loadAuth()
	if err != nil {
		return nil, err
	}
	c := &sim.Credentials{Operator: s.AdminToken}
	if s.Auth.Required() {
		k, err := auth.NewKey(s.Auth.Key)
		if err != nil {
			return nil, err
		}
		c.Engine = sim.MintEngineTokens(k)
	}
	if c.Engine == nil && c.Operator == "" {
		return nil, nil
	}
	return c, nil
}

// simHTTPClient is the simulator's HTTP client when the services serve
// HTTPS with a CA of their own or want a client certificate
// (KVMESH_HTTP_CA_FILE, KVMESH_HTTP_CLIENT_CERT_FILE): the data plane's
// transport with that TLS configuration. Nil keeps the simulator's own.
func simHTTPClient() (*http.Client, error) {
	var t service.HTTPTLS
	if err := config.Load(&t, os.LookupEnv); err != nil {
		return nil, err
	}
	if t.CAFile == "" && t.ClientCertFile == "" {
		return nil, nil
	}
	cfg, err := t.Client()
	if err != nil {
		return nil, err
	}
	tr := dataplane.DefaultTransport()
	tr.TLSClientConfig = cfg
	hc := dataplane.HTTPClient(tr)
	hc.Timeout = 30 * time.Second
	return hc, nil
}

// cliTransport is the transport of the CLI's calls to the services: HTTPS
// verified with KVMESH_HTTP_CA_FILE (the system roots when unset), with
// KVMESH_HTTP_CLIENT_CERT_FILE and _KEY_FILE presented to services that
// require a client certificate. A bad setting is reported on the call
// (the transport then refuses every HTTPS connection), not ignored.
func cliTransport() *http.Transport {
	tr := &http.Transport{}
	var t service.HTTPTLS
	if err := config.Load(&t, os.LookupEnv); err != nil {
		tr.DialTLSContext = func(context.Context, string, string) (net.Conn, error) { return nil, err }
		return tr
	}
	cfg, err := t.Client()
	if err != nil {
		tr.DialTLSContext = func(context.Context, string, string) (net.Conn, error) { return nil, err }
		return tr
	}
	tr.TLSClientConfig = cfg
	return tr
}
