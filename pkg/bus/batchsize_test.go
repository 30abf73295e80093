package bus_test

import (
	"errors"
	"testing"

	"github.com/kvmesh/kvmesh/pkg/bus"
)

// TestProducerBatchSize: a producer takes a batch size of 0 (kafka-go's
// default) or more and refuses a negative one.
func TestProducerBatchSize(t *testing.T) {
	for _, tt := range []struct {
		size int
		ok   bool
	}{{0, true}, {1, true}, {100, true}, {-1, false}} {
		p, err := bus.NewProducer([]string{"127.0.0.1:9"}, bus.WithBatchSize(tt.size))
		switch {
		case tt.ok && err != nil:
			t.Fatalf("WithBatchSize(%d): %v", tt.size, err)
		case !tt.ok && !errors.Is(err, bus.ErrInvalidConfig):
			t.Fatalf("WithBatchSize(%d) = %v, want ErrInvalidConfig", tt.size, err)
		}
		if p != nil {
			_ = p.Close()
		}
	}
}
