package kvmem

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvmesh/kvmesh/pkg/retry"
)

// Segment is a KV memory in a shared-memory file both the engine and the
// gpuworker map.
//
// # Liveness lock
//
// A segment opened with Open (the gpuworker's side of a registration)
// keeps a descriptor of the file open and holds a shared advisory lock
// (flock LOCK_SH) on it until Close; the kernel drops it when the process
// dies. A segment made with Create (the engine's side) keeps a descriptor
// of its own, unlocked, that Mapped probes with a non-blocking exclusive
// lock: refused, some other open of the file still holds the segment.
// flock locks belong to an open file description, not a process, so the
// probe sees another Open in the same process too, and two Opens of one
// file (a registration repeated) never conflict: shared locks are
// compatible.
type Segment struct {
	*host
	path string
	mem  []byte
	// f is the descriptor the segment keeps open: Open's holds the shared
	// lock (when the filesystem supports flock), Create's is the probe's.
	f *os.File
	// probe is set on a segment made with Create: Mapped may lock f.
	probe bool
	// mu serialises Mapped's lock and unlock of f, and Close.
	mu sync.Mutex
}

// ShmDir is where segments are made: /dev/shm when it exists, else the
// temporary directory.
func ShmDir() string {
	if st, err := os.Stat("/dev/shm"); err == nil && st.IsDir() {
		return "/dev/shm"
	}
	return os.TempDir()
}

// Create makes a new segment file at path (it must not exist) of layout
// l, maps it and writes its header. The file is sparse: pages are
// committed as blocks are written. Every record holds nothing. The
// segment keeps a descriptor of the file open for Mapped.
func Create(path string, l Layout) (*Segment, error) {
	if err := l.Validate(); err != nil {
		return nil, err
	}
	hdr, err := encodeHeader(l)
	if err != nil {
		return nil, err
	}
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return nil, fmt.Errorf("create segment: %w", err)
	}
	size := l.Offsets().Size
	if err := f.Truncate(size); err != nil {
		_ = f.Close()
		_ = os.Remove(path)
		return nil, fmt.Errorf("size segment %s: %w", path, err)
	}
	mem, err := unix.Mmap(int(f.Fd()), 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		_ = f.Close()
		_ = os.Remove(path)
		return nil, fmt.Errorf("map segment %s: %w", path, err)
	}
	copy(mem, hdr)
	return &Segment{host: newHost(l, mem), path: path, mem: mem, f: f, probe: true}, nil
}

// lockWait bounds how long Open waits for an exclusive lock on the
// segment to go: Mapped holds one only for an instant.
const lockWait = 5 * time.Second

// Open maps an existing segment and checks its header: the magic, the
// version, a valid layout equal to want, and a file at least as large as
// the layout needs. It then takes a shared lock on the file and holds it
// until Close (see Segment): the creator's Mapped reports the segment
// mapped meanwhile. On a filesystem without flock the segment is opened
// without it; a file another process holds locked exclusively for
// longer than lockWait is refused (ErrSegment).
func Open(path string, want Layout) (*Segment, error) {
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return nil, fmt.Errorf("open segment: %w", err)
	}
	seg, err := openFile(f, path, want)
	if err != nil {
		_ = f.Close()
		return nil, err
	}
	return seg, nil
}

// openFile is Open of the opened file f; the caller closes f on an error.
func openFile(f *os.File, path string, want Layout) (*Segment, error) {
	st, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("stat segment %s: %w", path, err)
	}
	if !st.Mode().IsRegular() || st.Size() < HeaderSize {
		return nil, fmt.Errorf("%s: %d bytes, not a segment file: %w", path, st.Size(), ErrSegment)
	}
	mem, err := unix.Mmap(int(f.Fd()), 0, int(st.Size()), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("map segment %s: %w", path, err)
	}
	l, err := checkSegment(mem, want)
	if err == nil {
		err = lockShared(f, lockWait)
	}
	if err != nil {
		_ = unix.Munmap(mem)
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return &Segment{host: newHost(l, mem), path: path, mem: mem, f: f}, nil
}

// lockBackoff spaces lockShared's tries: an exclusive lock held by a
// creator's Mapped goes within microseconds.
var lockBackoff = retry.Backoff{Initial: 50 * time.Microsecond, Max: 10 * time.Millisecond}

// lockShared takes a shared flock on f, waiting up to wait for an
// exclusive one to go (a creator's Mapped, which holds it for an instant;
// polled rather than blocking, so a process that never lets go cannot
// hang the caller). A filesystem without flock is no error: the segment
// then carries no liveness signal, and Mapped on it fails.
func lockShared(f *os.File, wait time.Duration) error {
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	_, err := retry.Attempts(ctx, lockBackoff, func(int) (struct{}, error) {
		err := unix.Flock(int(f.Fd()), unix.LOCK_SH|unix.LOCK_NB)
		if err != nil && !errors.Is(err, unix.EWOULDBLOCK) && !errors.Is(err, unix.EINTR) {
			return struct{}{}, nil // no flock here (ENOLCK, EOPNOTSUPP, ...): no signal
		}
		return struct{}{}, err
	})
	if err != nil {
		return fmt.Errorf("locked exclusively by another process for over %v: %w", wait, ErrSegment)
	}
	return nil
}

// Mapped reports whether another open of the segment's file holds it:
// whether some process (the gpuworker it was registered with, or another
// in this one) opened the file with Open and has neither closed that
// segment nor died. It tries a non-blocking exclusive flock on the
// creator's own descriptor and releases it at once; refused means another
// descriptor holds Open's shared lock.
//
// True proves only that: some open of this file (by path, on this
// kernel) is still mapped. It does not prove that the holder is the
// worker the segment was registered with, that the segment is still that
// worker's pool memory (its Close, after a replacing registration, comes
// an instant after the replacement), nor that the worker answers. False
// proves nobody holds it; a worker on another host, which could never
// map this segment, holds nothing. It is a flock, so it needs a
// filesystem that has them (tmpfs, /dev/shm, has): an error (no flock
// here, or a segment not made by Create, or closed) says nothing either
// way, and the caller must ask the worker.
func (s *Segment) Mapped() (bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case s.f == nil:
		return false, fmt.Errorf("segment %s is closed: %w", s.path, ErrSegment)
	case !s.probe:
		return false, fmt.Errorf("segment %s was opened, not created: it holds its own lock: %w", s.path, ErrSegment)
	}
	fd := int(s.f.Fd())
	for {
		err := unix.Flock(fd, unix.LOCK_EX|unix.LOCK_NB)
		switch {
		case err == nil:
			if err := unix.Flock(fd, unix.LOCK_UN); err != nil {
				return false, fmt.Errorf("unlock segment %s: %w", s.path, err)
			}
			return false, nil
		case errors.Is(err, unix.EINTR):
			continue
		case errors.Is(err, unix.EWOULDBLOCK):
			return true, nil
		default:
			return false, fmt.Errorf("lock segment %s: %w", s.path, err)
		}
	}
}

// checkSegment checks a mapped segment's header against want.
func checkSegment(mem []byte, want Layout) (Layout, error) {
	l, err := decodeHeader(mem)
	if err != nil {
		return l, err
	}
	if !l.Equal(want) {
		return l, fmt.Errorf("the segment's layout is not the registered one: %w", ErrLayout)
	}
	if size := l.Offsets().Size; int64(len(mem)) < size {
		return l, fmt.Errorf("%d bytes, the layout needs %d: %w", len(mem), size, ErrSegment)
	}
	return l, nil
}

// Kind is KindShm.
func (*Segment) Kind() string { return KindShm }

// Path is the segment's file.
func (s *Segment) Path() string { return s.path }

// Close unmaps the segment (the file stays), then closes its descriptor,
// which releases Open's shared lock: the segment is no longer mapped here.
func (s *Segment) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	var err error
	if s.mem != nil {
		if uerr := unix.Munmap(s.mem); uerr != nil {
			err = fmt.Errorf("unmap segment %s: %w", s.path, uerr)
		}
		s.mem = nil
	}
	if s.f != nil {
		if cerr := s.f.Close(); cerr != nil {
			err = errors.Join(err, fmt.Errorf("close segment %s: %w", s.path, cerr))
		}
		s.f = nil
	}
	return err
}

// Remove unmaps the segment and deletes its file (the creator's cleanup;
// a gpuworker that mapped it keeps its mapping until it closes it).
func (s *Segment) Remove() error {
	err := s.Close()
	if rmErr := os.Remove(s.path); rmErr != nil && !errors.Is(rmErr, os.ErrNotExist) {
		err = errors.Join(err, fmt.Errorf("remove segment: %w", rmErr))
	}
	return err
}
