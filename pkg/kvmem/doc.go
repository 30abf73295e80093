// Package kvmem is the KV memory an engine owns and registers with its
// rank's gpuworker: the segment layout both sides use, the per-block
// identity records and their protocol, the engine-side writer, and the
// Memory implementations the gpuworker's pool moves bytes through (heap,
// a shared-memory segment, and CUDA device memory behind the cuda build
// tag).
//
// # Segment layout
//
// A segment is one file (in /dev/shm on Linux) both processes map shared.
// It starts with a HeaderSize header: the magic "KVMEMSEG", the format
// version and the Layout as JSON. Then come the identity records, group by
// group, RecordSize bytes per block; then, page aligned, the data: per
// group one tensor per region (per layer where the engine keeps one tensor
// per layer, one region where a block is contiguous), each tensor
// blocks × region-bytes long, so block b's region r lies at b × bytes(r)
// of that tensor, as in vLLM's paged KV cache. A block's bytes are its
// regions in order; their sum is the group's bytes_per_block. Every offset
// follows from the Layout alone (Layout.Offsets), so the descriptor is all
// the two sides share.
//
// # Identity records
//
// Each block has a record: a sequence counter, the write generation, when
// the write completed (unix nanoseconds), the lengths, the writer (engine
// or gpuworker), the chunk hash (up to dataplane.MaxHashLen bytes) and the
// request id (truncated to RecordRequestIDLen bytes). Every field is a
// 64-bit word read and written with sync/atomic (aligned words of the
// mapping), so no reader ever sees a torn field.
//
// A writer (the engine computing KV, or the gpuworker loading a block):
//
//  1. Begin: compare-and-swap the sequence from even s to s+1 (odd: a write
//     is in progress) and clear the lengths; a writer that finds it odd
//     is refused (ErrBusy): two writers of one block at once is a protocol
//     violation that nothing could detect afterwards.
//  2. Write the bytes.
//  3. Commit: store the hash, request id, generation and completion time,
//     then compare-and-swap the sequence from s+1 to s+2 (even). A failed
//     write (Abort) leaves the lengths cleared: the block holds nothing.
//
// A reader (the gpuworker putting, or serving a pd read): Load the
// sequence (it must be even) and the record (it must hold the asked hash),
// use the bytes (copy them out), then check the sequence is unchanged with
// a compare-and-swap of s to s (Unchanged); otherwise whatever it made from
// the bytes is discarded, never stored or sent. The read-modify-write is a
// full barrier on every architecture Go supports, so no byte load of step
// two is ordered after it (a plain atomic load would be only an acquire on
// arm64); likewise Begin's compare-and-swap orders the byte stores after
// it. Eviction is Begin plus Abort.
//
// A writer that dies mid-write leaves its record odd; the block is never
// read until the engine, the memory's owner, resets it: the engine calls
// Writer.RecoverWorkerWrites before registering a segment with a new
// gpuworker, which clears the records a dead gpuworker left odd.
//
// # Liveness
//
// A segment opened with Open (the gpuworker's registration) holds a shared
// flock on the file until Close; the kernel drops it when the process
// dies. The creator's Segment.Mapped probes it with a non-blocking
// exclusive lock, so an engine learns that its worker no longer maps the
// segment (it died, restarted, or another registration replaced it)
// without asking the worker over HTTP before every access.
//
// The race detector does not see memory outside the Go heap, so accesses
// to a shared segment are never reported; the protocol's tests race a
// writer process against readers over a real segment and check that every
// accepted block matches the record the reader checked.
package kvmem
