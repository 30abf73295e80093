package testenv

import (
	"context"
	"os/exec"
	"path/filepath"
	"slices"
	"testing"
	"time"
)

// pgbenchWait bounds one pgbench command.
const pgbenchWait = 5 * time.Minute

// Pgbench runs PostgreSQL's pgbench (from PATH, else the newest under
// /usr/lib/postgresql) with args and returns its combined output; t fails
// when pgbench is not installed.
func Pgbench(t testing.TB, args ...string) (string, error) {
	t.Helper()
	path, err := exec.LookPath("pgbench")
	if err != nil {
		matches, _ := filepath.Glob("/usr/lib/postgresql/*/bin/pgbench")
		if len(matches) == 0 {
			t.Fatal("pgbench is not installed (Debian: postgresql-client)")
		}
		slices.Sort(matches)
		path = matches[len(matches)-1]
	}
	ctx, cancel := context.WithTimeout(context.Background(), pgbenchWait)
	defer cancel()
	out, err := exec.CommandContext(ctx, path, args...).CombinedOutput()
	return string(out), err
}
