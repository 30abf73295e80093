package sim

import (
	"context"
	"fmt"
	"os"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/kvmesh/kvmesh/internal/devbroker"
	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/bus"
)

// TestMain runs the tests, removes the service binaries the mesh tests
// built, and fails a passing run that left goroutines behind.
func TestMain(m *testing.M) {
	code := m.Run()
	if err := testenv.RemoveBinaries(); err != nil {
		fmt.Fprintln(os.Stderr, "remove test binaries:", err)
	}
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			code = 1
		}
	}
	os.Exit(code)
}

func startBroker(t *testing.T) []string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	b, err := devbroker.Start(ctx, devbroker.Config{Addr: "127.0.0.1:0", Partitions: 3, Topics: []string{"t"}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Close)
	return b.Addrs()
}

func publish(t *testing.T, brokers []string, keys ...string) {
	t.Helper()
	p, err := bus.NewProducer(brokers)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	var msgs []bus.Message
	for _, k := range keys {
		msgs = append(msgs, bus.Message{Topic: "t", Key: k, Value: []byte("v-" + k)})
	}
	if err := p.Publish(context.Background(), msgs...); err != nil {
		t.Fatal(err)
	}
}

// TestTailFromEnd: records published before the tail's offsets were taken
// are not delivered; every record after is, once.
func TestTailFromEnd(t *testing.T) {
	brokers := startBroker(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	publish(t, brokers, "old-1", "old-2")
	from, err := topicOffsets(ctx, brokers, bus.Security{}, "t", false)
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	got := map[string]int{}
	tctx, stop := context.WithCancel(ctx)
	errc := make(chan error, 1)
	go func() {
		errc <- tailTopic(tctx, brokers, bus.Security{}, "t", from, time.Minute, func(r Record) {
			mu.Lock()
			defer mu.Unlock()
			got[r.Key]++
		})
	}()
	var keys []string
	for i := range 20 {
		keys = append(keys, fmt.Sprintf("new-%d", i))
	}
	publish(t, brokers, keys...)
	deadline := time.Now().Add(20 * time.Second)
	for {
		mu.Lock()
		n := len(got)
		mu.Unlock()
		if n >= len(keys) || time.Now().After(deadline) {
			break
		}
		time.Sleep(20 * time.Millisecond) // polling interval
	}
	stop()
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	for _, k := range keys {
		if got[k] != 1 {
			t.Errorf("%s delivered %d times", k, got[k])
		}
	}
	if got["old-1"]+got["old-2"] != 0 {
		t.Errorf("records from before the offsets were delivered: %v", got)
	}
}

func TestReadAll(t *testing.T) {
	brokers := startBroker(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if recs, err := ReadAll(ctx, brokers, "t"); err != nil || len(recs) != 0 {
		t.Fatalf("empty topic: %d records, %v", len(recs), err)
	}
	publish(t, brokers, "a", "b", "c", "d", "e")
	recs, err := ReadAll(ctx, brokers, "t")
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	for _, r := range recs {
		if string(r.Value) != "v-"+r.Key || r.Topic != "t" {
			t.Fatalf("record %+v", r)
		}
		seen[r.Key] = true
	}
	if len(recs) != 5 || len(seen) != 5 {
		t.Fatalf("read %d records (%v), want the 5 published", len(recs), seen)
	}
	if _, err := ReadAll(ctx, brokers, "no-such-topic-"+NewRunTag()); err == nil {
		t.Fatal("a missing topic read without error")
	}
}
