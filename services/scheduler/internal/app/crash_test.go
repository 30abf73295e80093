package app_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"

	"github.com/kvmesh/kvmesh/internal/servicetest"
	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/database"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/services/scheduler/internal/app"
)

// process is a scheduler running as a subprocess.
type process struct {
	cmd  *exec.Cmd
	addr string
	log  string
	done chan error
}

// startProcess runs the binary with the env's settings plus extra variables
// and waits until it is ready.
func startProcess(t *testing.T, bin string, env *servicetest.Env, extra ...string) *process {
	t.Helper()
	p := &process{addr: testenv.FreeAddr(t), log: filepath.Join(t.TempDir(), "scheduler.log"), done: make(chan error, 1)}
	logFile, err := os.Create(p.log)
	if err != nil {
		t.Fatal(err)
	}
	p.cmd = exec.Command(bin)
	p.cmd.Env = append(os.Environ(),
		"KVMESH_AUTH=off",
		"KVMESH_KAFKA_BROKERS="+strings.Join(env.Brokers, ","),
		"KVMESH_DATABASE_URL="+env.DatabaseURL,
		"KVMESH_HTTP_ADDR="+p.addr,
		"KVMESH_SCHEDULER_CONSUMERS=1",
		"KVMESH_KAFKA_SESSION_TIMEOUT=1s",
		"KVMESH_LOG_LEVEL=info",
	)
	p.cmd.Env = append(p.cmd.Env, extra...)
	p.cmd.Stdout, p.cmd.Stderr = logFile, logFile
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		p.done <- p.cmd.Wait()
		logFile.Close()
	}()
	t.Cleanup(func() {
		if p.cmd.ProcessState == nil {
			_ = p.cmd.Process.Kill()
			<-p.done
		}
		if t.Failed() {
			b, _ := os.ReadFile(p.log)
			t.Logf("scheduler log:\n%s", b)
		}
	})
	servicetest.WaitReady(t, p.addr)
	return p
}

// TestKilledAfterCommitBeforePublish: a scheduler that committed trackers
// and outbox rows but never published them (relay switched off, then
// SIGKILL) loses nothing: after a restart with the relay on, every task is
// published exactly once, and the ledger holds each exactly once.
func TestKilledAfterCommitBeforePublish(t *testing.T) {
	env := servicetest.NewEnv(t)
	bin := testenv.BuildBinary(t, "./services/scheduler")
	h := &mesh{t: t, ctx: context.Background(), brokers: env.Brokers, dbURL: env.DatabaseURL,
		out: newCollector(t, env.Brokers, outputs)}
	var err error
	if h.model, err = loadPreset("hybrid-mla-linear"); err != nil {
		t.Fatal(err)
	}
	h.pool = connect(t, env.DatabaseURL)
	transport := &kafka.Transport{}
	h.writer = &kafka.Writer{Addr: kafka.TCP(env.Brokers...), Balancer: &kafka.Murmur2Balancer{}, BatchTimeout: 2 * time.Millisecond,
		RequiredAcks: kafka.RequireAll, Transport: transport} // acknowledged: unacknowledged writes may land out of order
	t.Cleanup(func() { _ = h.writer.Close(); transport.CloseIdleConnections() })

	first := startProcess(t, bin, env, "KVMESH_OUTBOX_RELAY_DISABLED=true")
	const n = 5
	reqs := make([]*request, n)
	for i := range reqs {
		r := h.request(fmt.Sprintf("crash%d", i))
		r.admit(48)
		r.allocate(0, table(0, 3), "")
		r.step(kvcore.Step{Kind: kvcore.StepNew, Tokens: 48, Table: table(0, 3)})
		reqs[i] = r
	}
	unsent := func() int {
		var c int
		if err := h.pool.QueryRow(h.ctx, `SELECT count(*) FROM outbox WHERE topic = $1 AND sent_at IS NULL`, contract.TopicSaveTasks).Scan(&c); err != nil {
			t.Fatal(err)
		}
		return c
	}
	eventually(t, "the save tasks committed to the outbox", func() bool { return unsent() == n })
	if err := first.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	<-first.done
	h.out.sync(t)
	for _, r := range reqs {
		if s := r.saves(); len(s) != 0 {
			t.Fatalf("published before the restart: %+v", s)
		}
	}

	second := startProcess(t, bin, env)
	for _, r := range reqs {
		r.waitSaves(1)
	}
	waitGroupCaughtUp(t, env.Brokers, app.GroupID, contract.TopicEngineSteps)
	eventually(t, "outbox drained", func() bool { return unsent() == 0 })
	h.out.sync(t)
	for _, r := range reqs {
		if s := r.saves(); len(s) != 1 || s[0].End != 48 {
			t.Fatalf("request %s: save tasks on the topic %+v, want exactly one", r.id, s)
		}
		if c := h.outboxCount(contract.TopicSaveTasks, r.id); c != 1 {
			t.Fatalf("request %s: %d save rows in the outbox, want 1", r.id, c)
		}
	}
	var events int
	if err := h.pool.QueryRow(h.ctx, `SELECT count(*) FROM processed_records WHERE kind = 'step'`).Scan(&events); err != nil || events != 3*n {
		t.Fatalf("%d events in the ledger (%v), want %d", events, err, 3*n)
	}
	if err := second.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-second.done:
		if err != nil {
			t.Fatalf("scheduler after SIGTERM: %v", err)
		}
	case <-time.After(servicetest.StopWithin + 5*time.Second):
		t.Fatal("scheduler did not stop after SIGTERM")
	}
}

// waitGroupCaughtUp waits until group has committed offsets at the end of
// every partition of topic: every record was applied (a redelivered one
// included) by the time it returns.
func waitGroupCaughtUp(t *testing.T, brokers []string, group, topic string) {
	t.Helper()
	transport := &kafka.Transport{}
	defer transport.CloseIdleConnections()
	client := &kafka.Client{Addr: kafka.TCP(brokers...), Transport: transport}
	ctx := context.Background()
	meta, err := client.Metadata(ctx, &kafka.MetadataRequest{Topics: []string{topic}})
	if err != nil {
		t.Fatal(err)
	}
	var parts []int
	var offsets []kafka.OffsetRequest
	for _, p := range meta.Topics[0].Partitions {
		parts = append(parts, p.ID)
		offsets = append(offsets, kafka.LastOffsetOf(p.ID))
	}
	ends, err := client.ListOffsets(ctx, &kafka.ListOffsetsRequest{Topics: map[string][]kafka.OffsetRequest{topic: offsets}})
	if err != nil {
		t.Fatal(err)
	}
	end := map[int]int64{}
	for _, p := range ends.Topics[topic] {
		end[p.Partition] = p.LastOffset
	}
	eventually(t, "the consumer group to commit every record", func() bool {
		resp, err := client.OffsetFetch(ctx, &kafka.OffsetFetchRequest{GroupID: group, Topics: map[string][]int{topic: parts}})
		if err != nil {
			return false
		}
		for _, p := range resp.Topics[topic] {
			if end[p.Partition] > 0 && p.CommittedOffset < end[p.Partition] {
				return false
			}
		}
		return true
	})
}

func loadPreset(name string) (*kvcore.Model, error) { return kvcore.Preset(name) }

func connect(t *testing.T, url string) *pgxpool.Pool {
	t.Helper()
	pool, err := database.Connect(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}
