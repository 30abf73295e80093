package sending_test

import (
	"context"
	"strconv"
	"testing"

	"github.com/kvmesh/kvmesh/internal/dbtest"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
)

// BenchmarkHandleMalformedTask is the handler's cost for one malformed task
// (both groups dead-lettered: two dead_letters rows, the outcome and three
// outbox messages in one transaction), without the broker.
func BenchmarkHandleMalformedTask(b *testing.B) {
	f := newFixture(b, dbtest.NewPool(b), kvstore.NewMemory(kvstore.MemoryOptions{}))
	values := make([][]byte, b.N)
	for i := range values {
		task := saveTask(f.model, "bad"+strconv.Itoa(i), 0, 32, 0)
		task.BlockTable = kvcore.BlockTable{{0}}
		values[i] = encode(b, task)
	}
	b.ResetTimer()
	for _, v := range values {
		if err := f.p.Handle(context.Background(), f.record(v)); err != nil {
			b.Fatal(err)
		}
	}
}
