package bus

import (
	"errors"
	"fmt"

	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// Sentinel errors.
var (
	// ErrTransient marks a handler error worth retrying; see Transient.
	ErrTransient = errors.New("bus: transient failure")
	// ErrPermanent marks a handler error that retrying cannot fix; see
	// Permanent.
	ErrPermanent = errors.New("bus: permanent failure")
	// ErrInvalidConfig reports a producer or consumer configuration that
	// cannot work.
	ErrInvalidConfig = errors.New("bus: invalid config")
	// ErrNoTopic reports a message published without a topic.
	ErrNoTopic = errors.New("bus: message has no topic")
	// ErrAlreadyRunning reports a second concurrent Run of one Consumer.
	ErrAlreadyRunning = errors.New("bus: consumer already running")
	// errPanic wraps the value a handler panicked with.
	errPanic = errors.New("handler panicked")
)

// transientError marks its error as ErrTransient.
type transientError struct{ err error }

// Error returns the wrapped error's text.
func (e *transientError) Error() string { return e.err.Error() }

// Unwrap returns the wrapped error.
func (e *transientError) Unwrap() error { return e.err }

// Is reports ErrTransient as matching.
func (e *transientError) Is(target error) bool { return target == ErrTransient }

// Transient marks err as transient: the consumer retries the record with
// backoff and dead-letters it with kvcore.ReasonRetriesExhausted when the retry
// policy gives up. Transient(nil) is nil.
func Transient(err error) error {
	if err == nil {
		return nil
	}
	return &transientError{err: err}
}

// PermanentError is a handler failure that retrying cannot fix. Reason is a
// stable, machine-readable code (such as kvcore.ReasonUndecodable) that the consumer
// writes to the dead-letter record's contract.HeaderReason.
type PermanentError struct {
	// Reason is the stable reason code.
	Reason kvcore.Reason
	// Err is the underlying error; it may be nil.
	Err error
}

// Error returns "reason: underlying error".
func (e *PermanentError) Error() string {
	if e.Err == nil {
		return string(e.Reason)
	}
	return fmt.Sprintf("%s: %v", e.Reason, e.Err)
}

// Unwrap returns the underlying error.
func (e *PermanentError) Unwrap() error { return e.Err }

// Is reports ErrPermanent as matching.
func (e *PermanentError) Is(target error) bool { return target == ErrPermanent }

// Permanent marks a handler failure as permanent with a stable reason code:
// the consumer dead-letters the record at once, without retrying. A handler
// that cannot decode a record returns Permanent(kvcore.ReasonUndecodable, err).
func Permanent(reason kvcore.Reason, err error) error {
	return &PermanentError{Reason: reason, Err: err}
}

// classify returns the dead-letter reason of a handler error and whether the
// error is permanent. Errors that are neither Permanent nor Transient are
// treated as transient: an unknown failure is retried before it is given up.
func classify(err error) (reason kvcore.Reason, permanent bool) {
	var pe *PermanentError
	if errors.As(err, &pe) {
		if pe.Reason == "" {
			return kvcore.ReasonUnspecified, true
		}
		return pe.Reason, true
	}
	return kvcore.ReasonRetriesExhausted, false
}
