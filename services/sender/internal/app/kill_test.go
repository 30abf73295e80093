package app_test

import (
	"context"
	"reflect"
	"strconv"
	"strings"
	"testing"

	"github.com/kvmesh/kvmesh/internal/servicetest"
	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// The sender binary is SIGKILLed while it works through a batch of tasks;
// after a restart every task is completed exactly once in the accounting
// and reported under one result id (redelivery may repeat a result, never
// invent or lose one).
func TestSenderKilledMidBatch(t *testing.T) {
	const tasks = 60
	// Every task has four blocks per group of its own: a block holds one
	// chunk, and the worker refuses to save a block for another.
	s := newStack(t, stackOptions{engines: []string{"e1"}, noSender: true, poolBlocks: 4 * tasks})
	first := s.task(t, "e1", "kill-0", 0, 64, 0)
	all := []*kvcore.SaveTask{first}
	for i := 1; i < tasks; i++ {
		all = append(all, s.task(t, "e1", "kill-"+strconv.Itoa(i), 0, 64, kvcore.BlockID(4*i)))
	}
	s.publish(t, all...)

	addr := testenv.FreeAddr(t)
	env := map[string]string{
		"KVMESH_AUTH":          "off",
		"KVMESH_KAFKA_BROKERS": strings.Join(s.env.Brokers, ","), "KVMESH_DATABASE_URL": s.env.DatabaseURL,
		"KVMESH_REDIS_URL": s.redis, "KVMESH_HTTP_ADDR": addr, "KVMESH_KEY_PREFIX": s.prefix,
		"KVMESH_KAFKA_PARTITIONS": "2", "KVMESH_KAFKA_SESSION_TIMEOUT": "1s", "KVMESH_LOG_LEVEL": "debug",
	}
	bin := testenv.BuildBinary(t, "./services/sender")
	sender := startProcess(t, bin, env)
	var atKill int
	poll(t, "the first saves", func() bool {
		atKill = s.outcomes(t)
		return atKill >= 5
	})
	sender.kill()
	if atKill >= tasks {
		t.Fatalf("all %d tasks were done before the kill; the test did not kill mid-batch", tasks)
	}
	t.Logf("killed after %d of %d tasks", atKill, tasks)

	startProcess(t, bin, env)
	servicetest.WaitReady(t, addr)
	poll(t, "every task completed", func() bool { return s.outcomes(t) == tasks })

	var done []string
	rows, err := s.db.Query(context.Background(), "SELECT task_id FROM save_outcomes ORDER BY task_id")
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			t.Fatal(err)
		}
		done = append(done, id)
	}
	rows.Close()
	want := map[string]bool{}
	for _, task := range all {
		want[task.TaskID] = true
	}
	for _, id := range done {
		if !want[id] {
			t.Fatalf("outcome for unknown task %s", id)
		}
		delete(want, id)
	}
	if len(want) != 0 {
		t.Fatalf("tasks without an outcome: %v", want)
	}

	byID := map[string]contract.TransferResult{}
	poll(t, "a result per task on kvmesh.transfer.results", func() bool {
		s.got.mu.Lock()
		defer s.got.mu.Unlock()
		for _, r := range s.got.results {
			if prev, ok := byID[r.ResultID]; ok && !reflect.DeepEqual(prev, r) {
				t.Fatalf("result %s published twice with different content:\n%+v\n%+v", r.ResultID, prev, r)
			}
			byID[r.ResultID] = r
		}
		return len(byID) >= tasks
	})
	if len(byID) != tasks {
		t.Fatalf("%d distinct result ids, want %d", len(byID), tasks)
	}
	for _, r := range byID {
		if r.Status != "stored" || r.ResultID != "save/"+r.TaskID {
			t.Fatalf("result %+v", r)
		}
	}
	s.checkStored(t, first, 0)
	s.checkStored(t, all[tasks-1], 0)
	s.checkStored(t, all[tasks-1], 1)
}

// outcomes counts the save_outcomes rows.
func (s *stack) outcomes(t testing.TB) int {
	t.Helper()
	var n int
	if err := s.db.QueryRow(context.Background(), "SELECT count(*) FROM save_outcomes").Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}
