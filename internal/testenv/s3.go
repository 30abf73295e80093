package testenv

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"
)

// S3Bucket is the bucket StartS3 creates.
const S3Bucket = "kvmesh-tier"

// S3Region is the region the server signs in (versitygw's default).
const S3Region = "us-east-1"

// S3Server is a private S3 server that StartS3 started for one test:
// versitygw's posix backend over a directory of the test's, on a loopback
// port of its own, with one bucket (S3Bucket) and root credentials made for
// it. Each object is a plain file (ObjectFile), which a test may read,
// truncate or rewrite behind the server's back; the object's metadata
// (ETag, x-amz-meta-*, content type, checksums) is kept in sidecar files
// (ObjectMetaDir), not in extended attributes, so any filesystem will do.
type S3Server struct {
	bin     string
	dataDir string // the posix backend's root: <dataDir>/<bucket>/<key>
	metaDir string // its sidecar metadata: <metaDir>/<bucket>/<key>/meta/<attribute>
	addr    string
	access  string
	secret  string

	mu   sync.Mutex
	proc *serverProcess
}

// StartS3 starts versitygw (v1.8.0; scripts/s3server.sh builds it) as
//
//	versitygw --port 127.0.0.1:P --access A --secret S --region us-east-1 \
//	  --keep-alive --quiet posix --sidecar <dir>/meta <dir>/data
//
// with <dir> a t.TempDir(), waits until it answers HTTP, creates the bucket
// S3Bucket with a signed CreateBucket, and kills the server when the test
// ends. The binary is $KVMESH_S3_SERVER, else <module root>/.dev/bin/versitygw;
// without it the test is skipped, or fails when KVMESH_REQUIRE_SERVICES=1.
// It takes about 100 ms.
func StartS3(t testing.TB) *S3Server {
	t.Helper()
	bin := os.Getenv("KVMESH_S3_SERVER")
	if bin == "" {
		bin = filepath.Join(ModuleRoot(t), ".dev", "bin", "versitygw")
	}
	if err := awaitS3Build(t, bin); err != nil {
		unavailable(t, "the S3 server %s is not there (%v); build it with scripts/s3server.sh build (make test does) or set KVMESH_S3_SERVER", bin, err)
	}
	dir := t.TempDir()
	s := &S3Server{
		bin:     bin,
		dataDir: filepath.Join(dir, "data"),
		metaDir: filepath.Join(dir, "meta"),
		access:  "kvmesh-test-" + randomHex(t, 4),
		secret:  randomHex(t, 20),
	}
	for _, d := range []string{s.dataDir, s.metaDir} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	s.start(t, "")
	return s
}

// start launches the server on port (empty: a free one each attempt), waits
// until it answers HTTP and makes sure the bucket exists.
func (s *S3Server) start(t testing.TB, port string) {
	t.Helper()
	launch := func(int) (*serverProcess, error) {
		p := port
		if p == "" {
			var err error
			if p, err = freePort(); err != nil {
				return nil, err
			}
		}
		addr := net.JoinHostPort("127.0.0.1", p)
		args := []string{
			"--port", addr, "--access", s.access, "--secret", s.secret, "--region", S3Region,
			"--keep-alive", "--quiet",
			"posix", "--sidecar", s.metaDir, s.dataDir,
		}
		return launchServer("versitygw", s.bin, addr, args)
	}
	proc := startServer(t, launch, func(p *serverProcess) error { return answersHTTP(p.addr) })
	s.mu.Lock()
	s.proc, s.addr = proc, proc.addr
	s.mu.Unlock()
	if err := s.createBucket(); err != nil {
		t.Fatalf("versitygw on %s: create bucket %s: %v\n%s", proc.addr, S3Bucket, err, proc.Output())
	}
}

// Restart starts the server again, on the same port over the same data
// (stopping it first if it runs): the store coming back after an outage,
// where the clients still hold its address. The new process is killed when
// t ends.
func (s *S3Server) Restart(t testing.TB) {
	t.Helper()
	s.Stop()
	_, port, err := net.SplitHostPort(s.Addr())
	if err != nil {
		t.Fatalf("restart versitygw: %v", err)
	}
	s.start(t, port)
}

// Stop kills the server and waits until it has exited; its data stays.
// Stopping a stopped server does nothing.
func (s *S3Server) Stop() {
	s.mu.Lock()
	p := s.proc
	s.mu.Unlock()
	p.Stop()
}

// Output returns what the running (or last) server process has written.
func (s *S3Server) Output() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.proc.Output()
}

// Addr returns the server's host:port.
func (s *S3Server) Addr() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.addr
}

// Endpoint returns the server's base URL, http://127.0.0.1:P.
func (s *S3Server) Endpoint() string { return "http://" + s.Addr() }

// Bucket returns the bucket StartS3 created (S3Bucket).
func (s *S3Server) Bucket() string { return S3Bucket }

// Region returns the region to sign requests for (S3Region).
func (s *S3Server) Region() string { return S3Region }

// AccessKey returns the server's root access key.
func (s *S3Server) AccessKey() string { return s.access }

// SecretKey returns the server's root secret key.
func (s *S3Server) SecretKey() string { return s.secret }

// URL returns Endpoint()/Bucket(), the form of KVMESH_TIER_URL
// (path-style addressing).
func (s *S3Server) URL() string { return s.Endpoint() + "/" + S3Bucket }

// ObjectFile returns the file that holds object key of the bucket: the
// key is the path below the bucket's directory as it is, each '/' a
// directory level and no escaping of other bytes ("a/b c+d" is
// <data>/kvmesh-tier/a/b c+d). So, as for the server, empty and "." / ".."
// segments are cleaned away ("a//b" is "a/b"), a key cannot be both an
// object and the prefix of another ("a" and "a/b"), and a segment may hold
// at most 255 bytes (longer: KeyTooLongError).
func (s *S3Server) ObjectFile(key string) string {
	return filepath.Join(s.dataDir, S3Bucket, filepath.FromSlash(key))
}

// ObjectMetaDir returns the directory of object key's metadata: one file
// per attribute, "etag" (the quoted ETag), "metadata" (the x-amz-meta-*
// pairs as a JSON object, names lower-cased and without the prefix),
// "content-type" and "checksums" (JSON). Rewriting the object's file leaves
// them as they were: the server then answers with the new bytes and size
// under the old ETag.
func (s *S3Server) ObjectMetaDir(key string) string {
	return filepath.Join(s.metaDir, S3Bucket, filepath.FromSlash(key), "meta")
}

// answersHTTP is nil once an HTTP request to addr gets an answer, whatever
// its status (403 for this unsigned one).
func answersHTTP(addr string) error {
	c := &http.Client{Timeout: time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	resp, err := c.Get("http://" + addr + "/")
	if err != nil {
		return err
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	return resp.Body.Close()
}

// createBucket makes S3Bucket through the minio-go client (signed with
// the server's root credentials); an existing bucket (a restarted server)
// is fine.
func (s *S3Server) createBucket() error {
	c, err := minio.New(s.Addr(), &minio.Options{Creds: credentials.NewStaticV4(s.access, s.secret, ""), Region: S3Region,
		BucketLookup: minio.BucketLookupPath, Transport: &http.Transport{DisableKeepAlives: true}})
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	err = c.MakeBucket(ctx, S3Bucket, minio.MakeBucketOptions{Region: S3Region})
	if code := minio.ToErrorResponse(err).Code; code == minio.BucketAlreadyOwnedByYou {
		return nil
	}
	return err
}

// s3BuildWait bounds how long StartS3 waits for a background build of
// versitygw (make deps starts one; make test does not wait for it before
// go test, so the build overlaps the tests that need no S3 server).
const s3BuildWait = 15 * time.Minute

// awaitS3Build returns nil once bin is a file: at once when it is, else
// while scripts/s3server.sh build-bg is building it (its pid file names a
// live process), polling until it appears, the build ends without it, or
// s3BuildWait passes.
func awaitS3Build(t testing.TB, bin string) error {
	t.Helper()
	pidFile := filepath.Join(ModuleRoot(t), ".dev", "pids", "versitygw-build")
	deadline := time.Now().Add(s3BuildWait)
	logged := false
	for {
		fi, err := os.Stat(bin)
		if err == nil && !fi.IsDir() {
			return nil
		}
		if err == nil {
			err = fmt.Errorf("%s is a directory", bin)
		}
		if !buildRunning(pidFile) || time.Now().After(deadline) {
			return err
		}
		if !logged {
			t.Logf("waiting for the background versitygw build (scripts/s3server.sh build-bg) to write %s", bin)
			logged = true
		}
		time.Sleep(time.Second) // polling a build in another process, under a deadline
	}
}

// buildRunning reports whether pidFile names a live process.
func buildRunning(pidFile string) bool {
	b, err := os.ReadFile(pidFile)
	if err != nil {
		return false
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || pid <= 0 {
		return false
	}
	return syscall.Kill(pid, 0) == nil
}
