package sending_test

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/internal/servicetest"
	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/database"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
	"github.com/kvmesh/kvmesh/services/sender/internal/sending"
)

// panicky is Workers whose lookup of engine "boom" panics.
type panicky struct{ engines }

func (p panicky) Engine(ctx context.Context, id string) (map[kvcore.Rank]sending.Putter, error) {
	if id == "boom" {
		panic("worker registry exploded")
	}
	return p.engines.Engine(ctx, id)
}

// A handler panic inside the real consumer loop lands in dead_letters as
// handler_panic, the task is reported dead_lettered, and consumption goes on.
func TestHandlerPanicIsDeadLetteredThroughTheBus(t *testing.T) {
	env := servicetest.NewEnv(t)
	pool, err := database.Connect(context.Background(), env.DatabaseURL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	f := newFixture(t, pool, kvstore.NewMemory(kvstore.MemoryOptions{}), func(o *sending.Options) {
		o.Workers = panicky{o.Workers.(engines)}
	})
	c, err := bus.NewConsumer(bus.ConsumerConfig{
		Brokers: env.Brokers, GroupID: "kvmesh-sender", Topics: []string{contract.TopicSaveTasks},
		OnDeadLetter: f.p.DeadLetter, Logger: slog.New(slog.DiscardHandler),
		SessionTimeout: time.Second, HeartbeatInterval: 100 * time.Millisecond,
	}, f.p.Handle)
	if err != nil {
		t.Fatal(err)
	}
	servicetest.Start(t, c.Run)
	producer, err := bus.NewProducer(env.Brokers)
	if err != nil {
		t.Fatal(err)
	}
	defer producer.Close()

	boom := saveTask(f.model, "boom", 0, 32, 0)
	boom.EngineID = "boom"
	ok := saveTask(f.model, "after", 0, 32, 0)
	for _, task := range []*kvcore.SaveTask{boom, ok} { // one key, one partition: in this order
		if err := producer.Publish(context.Background(), bus.Message{Topic: contract.TopicSaveTasks, Key: "k", Value: encode(t, task)}); err != nil {
			t.Fatal(err)
		}
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		if _, done := f.outcome(t, ok.TaskID); done {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the task after the panic was never handled")
		}
		time.Sleep(10 * time.Millisecond) // polling interval
	}
	res, found := f.outcome(t, boom.TaskID)
	if !found || res.Status != "dead_lettered" || res.Groups[0].Reason != string(kvcore.ReasonHandlerPanic) {
		t.Fatalf("panicked task outcome %+v (found %v)", res, found)
	}
	var reason, detail string
	err = pool.QueryRow(context.Background(),
		"SELECT reason, detail FROM dead_letters WHERE task_id = $1 AND group_index IS NULL", boom.TaskID).Scan(&reason, &detail)
	if err != nil || reason != string(kvcore.ReasonHandlerPanic) || detail == "" {
		t.Fatalf("dead letter of the panicked task: %q %q %v", reason, detail, err)
	}
	if res, _ := f.outcome(t, ok.TaskID); res.Status != "stored" {
		t.Fatalf("task after the panic %+v, want stored", res)
	}
}
