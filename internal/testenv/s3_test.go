package testenv_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"

	"github.com/kvmesh/kvmesh/internal/testenv"
)

// s3Client is a minio client of s's root account at addr (s's own address,
// or a proxy's in front of it), path-style, in s's region (no
// GetBucketLocation), retrying nothing.
func s3Client(t *testing.T, s *testenv.S3Server, addr string) *minio.Client {
	t.Helper()
	c, err := minio.New(addr, &minio.Options{
		Creds:        credentials.NewStaticV4(s.AccessKey(), s.SecretKey(), ""),
		Region:       s.Region(),
		BucketLookup: minio.BucketLookupPath,
		MaxRetries:   1,
	})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func ctxWithin(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// getObject reads key whole.
func getObject(ctx context.Context, c *minio.Client, bucket, key string) ([]byte, minio.ObjectInfo, error) {
	o, err := c.GetObject(ctx, bucket, key, minio.GetObjectOptions{})
	if err != nil {
		return nil, minio.ObjectInfo{}, err
	}
	defer o.Close()
	data, err := io.ReadAll(o)
	if err != nil {
		return nil, minio.ObjectInfo{}, err
	}
	info, err := o.Stat()
	return data, info, err
}

// userMeta looks name up in the user metadata minio returns (keys in
// canonical header form, without X-Amz-Meta-).
func userMeta(info minio.ObjectInfo, name string) (string, bool) {
	for k, v := range info.UserMetadata {
		if strings.EqualFold(k, name) {
			return v, true
		}
	}
	return "", false
}

func TestS3ObjectsAreFiles(t *testing.T) {
	start := time.Now()
	s := testenv.StartS3(t)
	t.Logf("StartS3 took %v (%s, bucket %s)", time.Since(start), s.URL(), s.Bucket())
	if want := s.Endpoint() + "/" + s.Bucket(); s.URL() != want || !strings.HasPrefix(s.Endpoint(), "http://127.0.0.1:") {
		t.Fatalf("Endpoint %q, URL %q", s.Endpoint(), s.URL())
	}
	c := s3Client(t, s, s.Addr())
	ctx := ctxWithin(t, time.Minute)
	bucket := s.Bucket()
	if ok, err := c.BucketExists(ctx, bucket); err != nil || !ok {
		t.Fatalf("BucketExists(%s) = %v, %v", bucket, ok, err)
	}

	// Keys with directories and bytes that URLs escape are files by the same path.
	data := bytes.Repeat([]byte("kv-block "), 40_000) // 360 KB: several chunks and reads
	keys := []string{"blocks/ab/cdef01", "odd keys/a b+c=d%e&f~g,h;é"}
	for _, key := range keys {
		_, err := c.PutObject(ctx, bucket, key, bytes.NewReader(data), int64(len(data)), minio.PutObjectOptions{
			ContentType:  "application/octet-stream",
			UserMetadata: map[string]string{"Kvmesh-Hash": "h-" + key, "kvmesh-layout": "L1"},
		})
		if err != nil {
			t.Fatalf("PutObject %q: %v", key, err)
		}
		got, info, err := getObject(ctx, c, bucket, key)
		if err != nil || !bytes.Equal(got, data) {
			t.Fatalf("GetObject %q: %d bytes, %v", key, len(got), err)
		}
		if v, _ := userMeta(info, "kvmesh-hash"); v != "h-"+key {
			t.Errorf("GetObject %q: metadata %v", key, info.UserMetadata)
		}
		head, err := c.StatObject(ctx, bucket, key, minio.StatObjectOptions{})
		if err != nil {
			t.Fatalf("StatObject %q: %v", key, err)
		}
		if v, _ := userMeta(head, "kvmesh-layout"); v != "L1" || head.Size != int64(len(data)) || head.ContentType != "application/octet-stream" {
			t.Errorf("StatObject %q: size %d, type %q, metadata %v", key, head.Size, head.ContentType, head.UserMetadata)
		}
		file, err := os.ReadFile(s.ObjectFile(key))
		if err != nil || !bytes.Equal(file, data) {
			t.Fatalf("ObjectFile(%q) = %s: %d bytes, %v", key, s.ObjectFile(key), len(file), err)
		}
		var meta map[string]string
		raw, err := os.ReadFile(filepath.Join(s.ObjectMetaDir(key), "metadata"))
		if err == nil {
			err = json.Unmarshal(raw, &meta)
		}
		if err != nil || meta["kvmesh-hash"] != "h-"+key {
			t.Errorf("%s/metadata = %s (%v)", s.ObjectMetaDir(key), raw, err)
		}
	}

	// Truncating the file behind the server's back: it serves the bytes
	// that are left, under the ETag it stored.
	key := keys[0]
	before, err := c.StatObject(ctx, bucket, key, minio.StatObjectOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(s.ObjectFile(key), 100); err != nil {
		t.Fatal(err)
	}
	got, info, err := getObject(ctx, c, bucket, key)
	if err != nil || !bytes.Equal(got, data[:100]) || info.ETag != before.ETag {
		t.Fatalf("GetObject after truncation: %d bytes, ETag %s (was %s), %v", len(got), info.ETag, before.ETag, err)
	}

	// DeleteObject removes the file (and the directories it leaves empty).
	if err := c.RemoveObject(ctx, bucket, keys[1], minio.RemoveObjectOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(s.ObjectFile(keys[1])); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("ObjectFile after DeleteObject: %v", err)
	}
	if _, err := c.StatObject(ctx, bucket, keys[1], minio.StatObjectOptions{}); minio.ToErrorResponse(err).Code != "NoSuchKey" {
		t.Fatalf("StatObject after DeleteObject: %v", err)
	}

	// Stopped, the server answers nothing; restarted on the same port, it
	// serves the same data (the client's pooled connections are dead).
	s.Stop()
	if _, err := c.StatObject(ctxWithin(t, 5*time.Second), bucket, key, minio.StatObjectOptions{}); err == nil {
		t.Fatal("StatObject succeeded with the server stopped")
	}
	start = time.Now()
	s.Restart(t)
	t.Logf("Restart took %v", time.Since(start))
	if got, _, err := getObject(ctx, c, bucket, key); err != nil || !bytes.Equal(got, data[:100]) {
		t.Fatalf("GetObject after Restart: %d bytes, %v\n%s", len(got), err, s.Output())
	}
	if _, err := c.PutObject(ctx, bucket, "after/restart", strings.NewReader("x"), 1, minio.PutObjectOptions{}); err != nil {
		t.Fatalf("PutObject after Restart: %v", err)
	}
}

// TestS3ThroughDelayProxy: a proxy in front of the server slows a request
// down past a client's deadline, and down, fails it; back up, it serves.
func TestS3ThroughDelayProxy(t *testing.T) {
	s := testenv.StartS3(t)
	p := testenv.StartDelayProxy(t, s.Addr())
	c := s3Client(t, s, p.Addr())
	ctx := ctxWithin(t, time.Minute)
	if _, err := c.PutObject(ctx, s.Bucket(), "k", strings.NewReader("v"), 1, minio.PutObjectOptions{}); err != nil {
		t.Fatalf("PutObject through the proxy: %v", err)
	}
	p.SetDelay(300 * time.Millisecond)
	if _, err := c.StatObject(ctxWithin(t, 200*time.Millisecond), s.Bucket(), "k", minio.StatObjectOptions{}); err == nil {
		t.Fatal("StatObject within 200ms succeeded through a 300ms delay")
	}
	start := time.Now()
	if _, err := c.StatObject(ctx, s.Bucket(), "k", minio.StatObjectOptions{}); err != nil || time.Since(start) < 600*time.Millisecond {
		t.Fatalf("StatObject with the delay: %v after %v", err, time.Since(start))
	}
	p.SetDelay(0)
	p.SetDown(true)
	if _, err := c.StatObject(ctxWithin(t, 5*time.Second), s.Bucket(), "k", minio.StatObjectOptions{}); err == nil {
		t.Fatal("StatObject succeeded with the proxy down")
	}
	p.SetDown(false)
	if _, err := c.StatObject(ctx, s.Bucket(), "k", minio.StatObjectOptions{}); err != nil {
		t.Fatalf("StatObject with the proxy up again: %v", err)
	}
}

func TestDelayProxy(t *testing.T) {
	target := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		fmt.Fprintf(w, "%s %d", r.URL.Path, len(body))
	}))
	t.Cleanup(target.Close)
	p := testenv.StartDelayProxy(t, strings.TrimPrefix(target.URL, "http://"))
	client := &http.Client{Transport: &http.Transport{}}
	t.Cleanup(client.CloseIdleConnections)
	get := func(timeout time.Duration) (string, time.Duration, error) {
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		defer cancel()
		start := time.Now()
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+p.Addr()+"/x", strings.NewReader(strings.Repeat("b", 100_000)))
		if err != nil {
			return "", 0, err
		}
		resp, err := client.Do(req)
		if err != nil {
			return "", time.Since(start), err
		}
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		return string(body), time.Since(start), err
	}
	if body, _, err := get(5 * time.Second); err != nil || body != "/x 100000" {
		t.Fatalf("through the proxy: %q, %v", body, err)
	}

	p.SetDelay(100 * time.Millisecond)
	if body, took, err := get(5 * time.Second); err != nil || body != "/x 100000" || took < 200*time.Millisecond {
		t.Fatalf("with a 100ms delay: %q after %v, %v", body, took, err)
	}
	if _, took, err := get(150 * time.Millisecond); err == nil {
		t.Fatalf("with a 100ms delay, within 150ms: succeeded after %v", took)
	}
	p.SetDelay(0)

	// Down: an open connection is cut, a new one refused.
	conn, err := net.Dial("tcp", p.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := fmt.Fprintf(conn, "GET /open HTTP/1.1\r\nHost: x\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 4096)
	if err := conn.SetReadDeadline(time.Now().Add(5 * time.Second)); err != nil {
		t.Fatal(err)
	}
	if n, err := conn.Read(buf); err != nil || !strings.Contains(string(buf[:n]), "/open 0") {
		t.Fatalf("open connection: %q, %v", buf[:n], err)
	}
	p.SetDown(true)
	if n, err := conn.Read(buf); err == nil {
		t.Fatalf("connection not cut: read %q", buf[:n])
	}
	if c, err := net.DialTimeout("tcp", p.Addr(), time.Second); err == nil {
		c.Close()
		t.Fatal("the proxy down accepted a connection")
	}
	if _, _, err := get(5 * time.Second); err == nil {
		t.Fatal("a request through the proxy down succeeded")
	}
	p.SetDown(false)
	if body, _, err := get(5 * time.Second); err != nil || body != "/x 100000" {
		t.Fatalf("the proxy up again: %q, %v", body, err)
	}
}
