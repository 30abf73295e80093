package testenv

import (
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// Settings of the private PostgreSQL servers of StartTLSPostgres.
const (
	// TLSPostgresUser is the superuser of a TLSPostgres.
	TLSPostgresUser = "kvmesh"
	// TLSPostgresDatabase is the database its URL names (initdb's own).
	TLSPostgresDatabase = "postgres"
	// postgresStopWithin bounds a fast shutdown before the server is killed.
	postgresStopWithin = 10 * time.Second
	// postgresRunAs is the user the server runs as when the tests run as
	// root: initdb and postgres refuse to run as root.
	postgresRunAs = "postgres"
)

// TLSPostgres is a private PostgreSQL server that StartTLSPostgres started
// for one test: ssl=on with the server certificate of Certs, reachable on
// 127.0.0.1 over TLS only (pg_hba.conf has hostssl lines only), with a
// password-protected superuser.
type TLSPostgres struct {
	*serverProcess
	// Certs are the server's certificate and the CA that signed it.
	Certs *Certs
	// User and Password are the superuser's credentials.
	User, Password string
}

// StartTLSPostgres initialises a throwaway cluster with initdb in a
// temporary directory (as the postgres user when the tests run as root,
// the key file copied with that owner and mode 0600, which PostgreSQL
// insists on), starts postgres on a free loopback port with ssl=on and
// fsync off, waits until pg_isready answers, and shuts it down (fast
// shutdown, then SIGKILL) and removes it when the test ends. The binaries
// are the newest under /usr/lib/postgresql/*/bin, else initdb's on PATH;
// without them the test is skipped, or fails when KVMESH_REQUIRE_SERVICES=1.
func StartTLSPostgres(t testing.TB, certs *Certs) *TLSPostgres {
	t.Helper()
	bin := postgresBin(t)
	cred, uid, gid, err := postgresCredential()
	if err != nil {
		t.Fatalf("postgres (tls): %v", err)
	}
	// Not t.TempDir: its parent is private to this user, which the
	// postgres user may not be.
	dir, err := os.MkdirTemp("", "kvmesh-pgtls-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) }) // registered first: runs after the server's stop
	p := &TLSPostgres{Certs: certs, User: TLSPostgresUser, Password: randomHex(t, 16)}
	data := filepath.Join(dir, "data")
	files := map[string]string{
		"pwfile":     p.Password + "\n",
		"server.crt": mustRead(t, certs.ServerCert),
		"server.key": mustRead(t, certs.ServerKey),
	}
	for name, content := range files {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	if cred != nil {
		if err := chownAll(dir, uid, gid); err != nil {
			t.Fatalf("postgres (tls): %v", err)
		}
	}
	initdb := exec.Command(filepath.Join(bin, "initdb"), "-D", data, "-U", p.User,
		"--pwfile="+filepath.Join(dir, "pwfile"), "--auth-local=trust", "--auth-host=scram-sha-256",
		"-E", "UTF8", "--no-locale", "--no-sync")
	initdb.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
	if out, err := initdb.CombinedOutput(); err != nil {
		t.Fatalf("initdb: %v\n%s", err, out)
	}
	// TLS only: no host line for plain connections.
	hba := "local all all trust\nhostssl all all 127.0.0.1/32 scram-sha-256\nhostssl all all ::1/128 scram-sha-256\n"
	if err := os.WriteFile(filepath.Join(data, "pg_hba.conf"), []byte(hba), 0o600); err != nil {
		t.Fatal(err)
	}
	if cred != nil {
		if err := os.Chown(filepath.Join(data, "pg_hba.conf"), uid, gid); err != nil {
			t.Fatal(err)
		}
	}
	launch := func(int) (*serverProcess, error) {
		port, err := freePort()
		if err != nil {
			return nil, err
		}
		args := []string{
			"-D", data, "-p", port, "-k", dir, "-c", "listen_addresses=127.0.0.1",
			"-c", "ssl=on", "-c", "ssl_cert_file=" + filepath.Join(dir, "server.crt"),
			"-c", "ssl_key_file=" + filepath.Join(dir, "server.key"),
			"-c", "fsync=off", "-c", "full_page_writes=off", "-c", "max_connections=20",
			// Dynamic shared memory in the data directory: nothing is left
			// in /dev/shm should the server be killed.
			"-c", "dynamic_shared_memory_type=mmap",
		}
		s := &serverProcess{
			name: "postgres (tls)", addr: net.JoinHostPort("127.0.0.1", port),
			cmd: exec.Command(filepath.Join(bin, "postgres"), args...), out: &SyncBuffer{}, done: make(chan struct{}),
		}
		s.cmd.Stdout, s.cmd.Stderr = s.out, s.out
		s.cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred, Pdeathsig: syscall.SIGINT}
		if err := s.cmd.Start(); err != nil {
			return nil, fmt.Errorf("postgres (tls): %w", err)
		}
		go func() {
			_ = s.cmd.Wait() // a stopped server exits with an error by design
			close(s.done)
		}()
		return s, nil
	}
	isReady := filepath.Join(bin, "pg_isready")
	p.serverProcess = startServer(t, launch, func(s *serverProcess) error {
		_, port, _ := net.SplitHostPort(s.addr)
		out, err := exec.Command(isReady, "-h", "127.0.0.1", "-p", port, "-U", p.User, "-t", "1").CombinedOutput()
		if err != nil {
			return fmt.Errorf("pg_isready: %w: %s", err, strings.TrimSpace(string(out)))
		}
		return nil
	})
	t.Cleanup(p.shutdown) // runs before startServer's kill, which then finds it gone
	return p
}

// URL returns the server's postgres:// URL as the superuser, with sslmode
// and, when not empty, sslrootcert (a CA file).
func (p *TLSPostgres) URL(sslmode, rootCert string) string {
	return p.URLAs(p.User, p.Password, sslmode, rootCert)
}

// URLAs is URL with the given credentials.
func (p *TLSPostgres) URLAs(user, password, sslmode, rootCert string) string {
	q := url.Values{"sslmode": {sslmode}}
	if rootCert != "" {
		q.Set("sslrootcert", rootCert)
	}
	u := url.URL{Scheme: "postgres", User: url.UserPassword(user, password), Host: p.addr,
		Path: "/" + TLSPostgresDatabase, RawQuery: q.Encode()}
	return u.String()
}

// shutdown asks the server for a fast shutdown (SIGINT) and kills it when
// it has not exited within postgresStopWithin.
func (p *TLSPostgres) shutdown() {
	_ = p.cmd.Process.Signal(syscall.SIGINT) // fails only if it already exited
	select {
	case <-p.done:
	case <-time.After(postgresStopWithin):
		p.Stop()
	}
}

// postgresBin returns the directory of initdb and postgres, or skips or
// fails t.
func postgresBin(t testing.TB) string {
	t.Helper()
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin") // the pattern is valid
	slices.SortFunc(dirs, func(a, b string) int { return pgVersion(a) - pgVersion(b) })
	for _, d := range slices.Backward(dirs) {
		if _, err := os.Stat(filepath.Join(d, "initdb")); err == nil {
			return d
		}
	}
	if p, err := exec.LookPath("initdb"); err == nil {
		return filepath.Dir(p)
	}
	unavailable(t, "initdb is not installed (no /usr/lib/postgresql/*/bin/initdb, none on PATH); install postgresql")
	return ""
}

// pgVersion is the major version in /usr/lib/postgresql/VERSION/bin (0
// when it is not a number).
func pgVersion(dir string) int {
	n, _ := strconv.Atoi(filepath.Base(filepath.Dir(dir))) // 0 for a non-number sorts first
	return n
}

// postgresCredential is the credential to run initdb and postgres with:
// nil unless the tests run as root, then the postgres user's.
func postgresCredential() (*syscall.Credential, int, int, error) {
	if os.Geteuid() != 0 {
		return nil, 0, 0, nil
	}
	u, err := user.Lookup(postgresRunAs)
	if err != nil {
		return nil, 0, 0, fmt.Errorf("running as root, and PostgreSQL refuses root: %w", err)
	}
	uid, err := strconv.Atoi(u.Uid)
	if err != nil {
		return nil, 0, 0, err
	}
	gid, err := strconv.Atoi(u.Gid)
	if err != nil {
		return nil, 0, 0, err
	}
	return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}, uid, gid, nil
}

// chownAll gives dir and everything in it to uid:gid.
func chownAll(dir string, uid, gid int) error {
	return filepath.Walk(dir, func(path string, _ os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		return os.Chown(path, uid, gid)
	})
}

// mustRead returns the content of path or fails t.
func mustRead(t testing.TB, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}
