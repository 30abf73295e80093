package kvpublish

import (
	"testing"

	"go.uber.org/goleak"
)

// zmqPubWriterLeak is the goroutine go-zeromq/zmq4 v0.17.0 leaves behind
// per PUB socket: NewPub starts (*pubMWriter).run, and the socket's Close
// never closes the writer that would end it (pub.go). One per publisher,
// for the life of the process; nothing of kvmesh's.
const zmqPubWriterLeak = "github.com/go-zeromq/zmq4.(*pubMWriter).run"

func TestMain(m *testing.M) { goleak.VerifyTestMain(m, goleak.IgnoreAnyFunction(zmqPubWriterLeak)) }
