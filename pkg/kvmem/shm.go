package kvmem

import (
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// Segment is a KV memory in a shared-memory file both the engine and the
// gpuworker map.
type Segment struct {
	*host
	path string
	mem  []byte
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
// committed as blocks are written. Every record holds nothing.
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
	defer f.Close() // the mapping outlives the descriptor
	size := l.Offsets().Size
	if err := f.Truncate(size); err != nil {
		_ = os.Remove(path)
		return nil, fmt.Errorf("size segment %s: %w", path, err)
	}
	mem, err := unix.Mmap(int(f.Fd()), 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		_ = os.Remove(path)
		return nil, fmt.Errorf("map segment %s: %w", path, err)
	}
	copy(mem, hdr)
	return &Segment{host: newHost(l, mem), path: path, mem: mem}, nil
}

// Open maps an existing segment and checks its header: the magic, the
// version, a valid layout equal to want, and a file at least as large as
// the layout needs.
func Open(path string, want Layout) (*Segment, error) {
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return nil, fmt.Errorf("open segment: %w", err)
	}
	defer f.Close() // the mapping outlives the descriptor
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
	if err != nil {
		_ = unix.Munmap(mem)
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return &Segment{host: newHost(l, mem), path: path, mem: mem}, nil
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

// Close unmaps the segment (the file stays).
func (s *Segment) Close() error {
	if s.mem == nil {
		return nil
	}
	err := unix.Munmap(s.mem)
	s.mem = nil
	if err != nil {
		return fmt.Errorf("unmap segment %s: %w", s.path, err)
	}
	return nil
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
