// Package kvtier is the store pool's capacity tier: an S3-compatible object
// store below Redis. Tier wraps the Redis store (a kvstore.Store) so that
// every block Redis stores is copied behind it into the bucket, a block
// Redis no longer holds counts present only where the bucket confirms its
// object, and a block read from the bucket is handed to the same checks as
// a Redis value before it is promoted back into Redis. docs/operations.md
// ("The capacity tier") argues the design.
package kvtier

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"
)

// Sentinel errors; test with errors.Is.
var (
	// ErrBadURL reports a tier URL that is not http(s)://host[:port]/bucket[/prefix].
	ErrBadURL = errors.New("tier URL is not http(s)://host[:port]/bucket[/prefix]")
	// ErrNoBucket reports a bucket the object store does not have.
	ErrNoBucket = errors.New("the object store has no such bucket")
	// ErrNotFound reports an object the bucket does not hold.
	ErrNotFound = errors.New("object not in the tier")
	// ErrForeign reports an object whose metadata names another key (an
	// object copied or renamed under this key's name) or none.
	ErrForeign = errors.New("object does not name this key")
	// ErrTruncated reports an object body shorter or longer than its
	// recorded size.
	ErrTruncated = errors.New("object body is not its recorded size")
	// ErrUnavailable reports a failed call to the object store; it wraps the cause.
	ErrUnavailable = errors.New("object store unavailable")
)

// keyMeta is the user metadata (x-amz-meta-kvmesh-key) that names the
// store key an object was written for.
const keyMeta = "Kvmesh-Key"

// Location is where the tier's objects live.
type Location struct {
	// Endpoint is host[:port] of the S3 API.
	Endpoint string
	// Secure is true for https.
	Secure bool
	// Bucket is the bucket's name.
	Bucket string
	// Prefix is prepended to every object name ("" or ending in "/").
	Prefix string
}

// ParseURL reads a tier URL: http(s)://host[:port]/bucket[/prefix], the
// bucket addressed path-style.
func ParseURL(raw string) (Location, error) {
	u, err := url.Parse(raw)
	if err != nil {
		return Location{}, fmt.Errorf("%w: %v", ErrBadURL, err)
	}
	if (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || u.User != nil || u.RawQuery != "" {
		return Location{}, fmt.Errorf("%w: %q", ErrBadURL, redact(u))
	}
	bucket, prefix, _ := strings.Cut(strings.Trim(u.Path, "/"), "/")
	if bucket == "" {
		return Location{}, fmt.Errorf("%w: %q names no bucket", ErrBadURL, redact(u))
	}
	if prefix != "" {
		prefix += "/"
	}
	return Location{Endpoint: u.Host, Secure: u.Scheme == "https", Bucket: bucket, Prefix: prefix}, nil
}

// redact returns u without credentials or query, for an error message.
func redact(u *url.URL) string {
	c := *u
	c.User, c.RawQuery = nil, ""
	return c.String()
}

// Config opens the object tier.
type Config struct {
	// URL is the tier URL (ParseURL).
	URL string
	// AccessKey and SecretKey are the S3 credentials.
	AccessKey, SecretKey string
	// Region is the bucket's region (default "us-east-1").
	Region string
	// Timeout bounds one object call (default 10 s).
	Timeout time.Duration
	// Transport, when set, carries the calls (tests; default: a pooled
	// transport sized for the tier's writers).
	Transport http.RoundTripper
}

// Objects is the bucket of the tier, through the minio-go S3 client.
type Objects struct {
	c       *minio.Client
	loc     Location
	timeout time.Duration
}

// Open connects to the object store of cfg and checks that its bucket
// exists.
func Open(ctx context.Context, cfg Config) (*Objects, error) {
	loc, err := ParseURL(cfg.URL)
	if err != nil {
		return nil, err
	}
	if cfg.Region == "" {
		cfg.Region = "us-east-1"
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = 10 * time.Second
	}
	tr := cfg.Transport
	if tr == nil {
		t := http.DefaultTransport.(*http.Transport).Clone()
		t.MaxIdleConnsPerHost, t.MaxIdleConns = 64, 64
		tr = t
	}
	c, err := minio.New(loc.Endpoint, &minio.Options{
		Creds:        credentials.NewStaticV4(cfg.AccessKey, cfg.SecretKey, ""),
		Secure:       loc.Secure,
		Region:       cfg.Region,
		BucketLookup: minio.BucketLookupPath,
		Transport:    tr,
		MaxRetries:   1,
	})
	if err != nil {
		return nil, fmt.Errorf("object tier %s: %w", loc.Endpoint, err)
	}
	o := &Objects{c: c, loc: loc, timeout: cfg.Timeout}
	if err := o.Ping(ctx); err != nil {
		return nil, err
	}
	return o, nil
}

// Location says where the objects live.
func (o *Objects) Location() Location { return o.loc }

// Client is the S3 client, for a benchmark's raw baseline.
func (o *Objects) Client() *minio.Client { return o.c }

// Name is the object name of a store key.
func (o *Objects) Name(key string) string { return o.loc.Prefix + key }

// Ping checks that the bucket exists.
func (o *Objects) Ping(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, o.timeout)
	defer cancel()
	ok, err := o.c.BucketExists(ctx, o.loc.Bucket)
	if err != nil {
		return fmt.Errorf("object tier %s: %w: %w", o.loc.Endpoint, ErrUnavailable, err)
	}
	if !ok {
		return fmt.Errorf("object tier %s: bucket %q: %w", o.loc.Endpoint, o.loc.Bucket, ErrNoBucket)
	}
	return nil
}

// keyDigest is the metadata value that names key: the hex of its SHA-256's
// first 16 bytes (header-safe whatever the key's characters).
func keyDigest(key string) string {
	s := sha256.Sum256([]byte(key))
	return hex.EncodeToString(s[:16])
}

// Put writes value as key's object, naming key in its metadata. The
// object is visible only once the whole body is stored (S3's PUT).
func (o *Objects) Put(ctx context.Context, key string, value []byte) error {
	ctx, cancel := context.WithTimeout(ctx, o.timeout)
	defer cancel()
	_, err := o.c.PutObject(ctx, o.loc.Bucket, o.Name(key), bytes.NewReader(value), int64(len(value)), minio.PutObjectOptions{
		UserMetadata:         map[string]string{keyMeta: keyDigest(key)},
		ContentType:          "application/octet-stream",
		DisableMultipart:     true,
		DisableContentSha256: true, // the value carries its own crc32c, checked on every load
	})
	if err != nil {
		return o.fail("put", key, err)
	}
	return nil
}

// Head confirms key's object: present, of a non-zero size, and naming key.
func (o *Objects) Head(ctx context.Context, key string) error {
	ctx, cancel := context.WithTimeout(ctx, o.timeout)
	defer cancel()
	info, err := o.c.StatObject(ctx, o.loc.Bucket, o.Name(key), minio.StatObjectOptions{})
	if err != nil {
		return o.fail("head", key, err)
	}
	return checkInfo(key, info)
}

// checkInfo checks an object's metadata names key and its size is plausible.
func checkInfo(key string, info minio.ObjectInfo) error {
	if got := info.UserMetadata[keyMeta]; got != keyDigest(key) {
		return fmt.Errorf("key %s: metadata %q: %w", key, got, ErrForeign)
	}
	if info.Size <= 0 {
		return fmt.Errorf("key %s: size %d: %w", key, info.Size, ErrTruncated)
	}
	return nil
}

// Get reads key's object whole, in one GET, after checking that its
// metadata names key; a body of another length than the object's recorded
// size is ErrTruncated. The bytes are not otherwise checked: the caller
// verifies them as it would a Redis value.
func (o *Objects) Get(ctx context.Context, key string) ([]byte, error) {
	return o.read(ctx, key, newBuffer)
}

// newBuffer is a fresh buffer of length n, for a value its caller keeps.
func newBuffer(n int) []byte { return make([]byte, n) }

// read is Get with the body read into alloc(size+1)[:n].
func (o *Objects) read(ctx context.Context, key string, alloc func(n int) []byte) ([]byte, error) {
	ctx, cancel := context.WithTimeout(ctx, o.timeout)
	defer cancel()
	// minio.Core's GetObject answers the body and the object's info from
	// one GET (the Client's Object would HEAD first).
	body, info, _, err := minio.Core{Client: o.c}.GetObject(ctx, o.loc.Bucket, o.Name(key), minio.GetObjectOptions{})
	if err != nil {
		return nil, o.fail("get", key, err)
	}
	defer body.Close()
	if err := checkInfo(key, info); err != nil {
		return nil, err
	}
	buf := alloc(int(info.Size) + 1) // one more: a longer body is seen
	n, err := io.ReadFull(body, buf)
	switch {
	case errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF):
		if int64(n) != info.Size {
			return nil, fmt.Errorf("key %s: %d of %d bytes: %w", key, n, info.Size, ErrTruncated)
		}
		return buf[:n], nil
	case err != nil:
		return nil, o.fail("get", key, err)
	default:
		return nil, fmt.Errorf("key %s: more than %d bytes: %w", key, info.Size, ErrTruncated)
	}
}

// Remove deletes key's object; an absent object is not an error (S3's
// DELETE is idempotent).
func (o *Objects) Remove(ctx context.Context, key string) error {
	ctx, cancel := context.WithTimeout(ctx, o.timeout)
	defer cancel()
	if err := o.c.RemoveObject(ctx, o.loc.Bucket, o.Name(key), minio.RemoveObjectOptions{}); err != nil {
		return o.fail("remove", key, err)
	}
	return nil
}

// fail classifies an S3 error: an absent object is ErrNotFound, anything
// else ErrUnavailable, both wrapping the cause.
func (o *Objects) fail(op, key string, err error) error {
	switch minio.ToErrorResponse(err).Code {
	case minio.NoSuchKey:
		return fmt.Errorf("key %s: %w", key, ErrNotFound)
	case minio.NoSuchBucket:
		return fmt.Errorf("object tier %s: bucket %q: %w", o.loc.Endpoint, o.loc.Bucket, ErrNoBucket)
	}
	return fmt.Errorf("object tier %s %s %s: %w: %w", o.loc.Endpoint, op, key, ErrUnavailable, err)
}
