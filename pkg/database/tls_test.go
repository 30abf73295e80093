package database_test

import (
	"context"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/database"
)

// TestConnectVerifyFull connects to a PostgreSQL that accepts TLS
// connections only, with pgx's own URL parameters: sslmode=verify-full
// (and verify-ca) with sslrootcert naming the test CA succeed over TLS, as
// pg_stat_ssl shows; a client trusting another CA, a plain connection, a
// wrong password and a missing CA file are refused, each within a deadline
// and without the password in the error.
func TestConnectVerifyFull(t *testing.T) {
	certs := testenv.NewCerts(t)
	pg := testenv.StartTLSPostgres(t, certs)

	for _, mode := range []string{"verify-full", "verify-ca"} {
		t.Run(mode, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
			defer cancel()
			pool, err := database.Connect(ctx, pg.URL(mode, certs.CAFile))
			if err != nil {
				t.Fatalf("Connect: %v", err)
			}
			defer pool.Close()
			var ssl bool
			if err := pool.QueryRow(ctx, "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()").Scan(&ssl); err != nil {
				t.Fatal(err)
			}
			if !ssl {
				t.Error("pg_stat_ssl says the connection is not TLS")
			}
		})
	}

	// A password that needs escaping in a URL: the error must hide the
	// password however it is spelled.
	const odd = "p@ss/w:rd%secret"
	tests := []struct {
		name string
		url  string
		want string // in the error's text
	}{
		{"client trusts another CA", pg.URL("verify-full", certs.OtherCAFile), "certificate signed by unknown authority"},
		{"plain connection", pg.URL("disable", ""), "no encryption"},
		{"wrong password", pg.URLAs(pg.User, "not-"+pg.Password, "verify-full", certs.CAFile), "password authentication failed"},
		{"odd wrong password", pg.URLAs(pg.User, odd, "verify-full", certs.CAFile), "password authentication failed"},
		{"missing CA file", pg.URL("verify-full", certs.Dir+"/absent.pem"), "absent.pem"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
			defer cancel()
			start := time.Now()
			pool, err := database.Connect(ctx, tt.url, database.WithConnectTimeout(5*time.Second))
			if err == nil {
				pool.Close()
				t.Fatal("Connect succeeded")
			}
			t.Logf("error after %v: %v", time.Since(start).Round(time.Millisecond), err)
			if took := time.Since(start); took > 10*time.Second {
				t.Errorf("Connect took %v to fail", took)
			}
			if !strings.Contains(err.Error(), tt.want) {
				t.Errorf("error %q does not say %q", err, tt.want)
			}
			for _, secret := range []string{pg.Password, odd, url.QueryEscape(odd), url.PathEscape(odd), "w:rd%secret"} {
				if strings.Contains(err.Error(), secret) {
					t.Errorf("error %q shows the password (%q)", err, secret)
				}
			}
		})
	}
}
