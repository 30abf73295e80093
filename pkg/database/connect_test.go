package database_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/internal/dbtest"
	"github.com/kvmesh/kvmesh/pkg/database"
)

func TestMaskURL(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name, in, want string
	}{
		{"url with password", "postgres://kvmesh:s3cret@db:5432/kvmesh?sslmode=disable",
			"postgres://kvmesh:***@db:5432/kvmesh?sslmode=disable"},
		{"url without password", "postgres://kvmesh@127.0.0.1:15432/kvmesh",
			"postgres://kvmesh@127.0.0.1:15432/kvmesh"},
		{"url without user", "postgresql://db/kvmesh", "postgresql://db/kvmesh"},
		{"empty password", "postgres://u:@db/x", "postgres://u:***@db/x"},
		{"password with at sign", "postgres://u:p@ss@db/x", "postgres://u:***@db/x"},
		{"password with slash", "postgres://u:pa/ss@db/x", "postgres://u:***@db/x"},
		{"password with colon", "postgres://u:a:b@db/x", "postgres://u:***@db/x"},
		{"query password", "postgres://db/x?sslmode=disable&password=s3cret",
			"postgres://db/x?sslmode=disable&password=***"},
		{"both", "postgres://u:one@db/x?password=two&a=b", "postgres://u:***@db/x?password=***&a=b"},
		{"keyword value", "host=db user=u password=s3cret dbname=x",
			"host=db user=u password=*** dbname=x"},
		{"keyword value quoted", "host=db password='s3 cret' dbname=x", "host=db password=*** dbname=x"},
		{"keyword value spaced", "password = s3cret host=db", "password = *** host=db"},
		{"keyword value url-like password", "host=db password=a://b@c", "host=db password=***"},
		{"keyword value no password", "host=db user=u", "host=db user=u"},
		{"empty", "", ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := database.MaskURL(tt.in); got != tt.want {
				t.Errorf("MaskURL(%q) = %q, want %q", tt.in, got, tt.want)
			}
		})
	}
}

func TestConnectErrorsHidePassword(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name, url string
	}{
		{"unparsable port", "postgres://u:hunter2secret@127.0.0.1:notaport/x"},
		{"unreachable server", "postgres://u:hunter2secret@127.0.0.1:1/x?connect_timeout=2"},
		{"keyword value unreachable", "host=127.0.0.1 port=1 user=u password=hunter2secret connect_timeout=2"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			pool, err := database.Connect(ctx, tt.url, database.WithConnectTimeout(2*time.Second))
			if err == nil {
				pool.Close()
				t.Fatal("Connect succeeded, want an error")
			}
			t.Logf("error: %v", err)
			if strings.Contains(err.Error(), "hunter2secret") {
				t.Errorf("error leaks the password: %v", err)
			}
			if !strings.HasPrefix(err.Error(), "database: ") {
				t.Errorf("error %q lacks the package context", err)
			}
		})
	}
}

func TestConnectPingsServer(t *testing.T) {
	t.Parallel()
	u := dbtest.NewDatabase(t)
	pool, err := database.Connect(t.Context(), u, database.WithMaxConns(3))
	if err != nil {
		t.Fatalf("Connect: %v", err)
	}
	defer pool.Close()
	if got := pool.Config().MaxConns; got != 3 {
		t.Errorf("MaxConns = %d, want 3", got)
	}
	var one int
	if err := pool.QueryRow(t.Context(), "SELECT 1").Scan(&one); err != nil || one != 1 {
		t.Errorf("SELECT 1 = %d, %v", one, err)
	}
}
