package servicetest_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/kvmesh/kvmesh/internal/devbroker"
	"github.com/kvmesh/kvmesh/internal/servicetest"
	"github.com/kvmesh/kvmesh/pkg/contract"
)

// TestMaxValueBytesIsTheBrokersLimit checks that the junk of PoisonRecords
// is as large as a record can be: the broker takes a value of MaxValueBytes
// and refuses one byte more, for short and long keys.
func TestMaxValueBytesIsTheBrokersLimit(t *testing.T) {
	ctx := context.Background()
	b, err := devbroker.Start(ctx, devbroker.Config{Addr: "127.0.0.1:0", GroupMinSessionTimeout: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Close)
	raw := servicetest.NewRawProducer(t, b.Addrs())
	for _, key := range []string{"", "k", strings.Repeat("k", 63)} {
		n := servicetest.MaxValueBytes(len(key))
		at, err := raw.Produce(ctx, contract.TopicSaveTasks, key, make([]byte, n))
		if err != nil {
			t.Fatalf("key of %d bytes: a %d-byte value: %v", len(key), n, err)
		}
		if at.Topic != contract.TopicSaveTasks || at.Offset < 0 {
			t.Fatalf("produced at %+v", at)
		}
		_, err = raw.Produce(ctx, contract.TopicSaveTasks, key, make([]byte, n+1))
		if !errors.Is(err, kafka.MessageSizeTooLarge) {
			t.Fatalf("key of %d bytes: a %d-byte value: %v, want %v", len(key), n+1, err, kafka.MessageSizeTooLarge)
		}
	}
	records := servicetest.PoisonRecords(t, 1, []byte(`{"a":"bc"}`), []byte(`{}`))
	if len(records) != 3 || len(records[0].Value) != servicetest.MaxValueBytes(1) || string(records[1].Value) != `{"a":` {
		t.Fatalf("poison records: %d, junk of %d bytes, truncated %q", len(records), len(records[0].Value), records[1].Value)
	}
}
