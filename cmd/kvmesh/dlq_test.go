package main

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// seedTask is a save of tokens [0,32) of req with table, hashed under the
// stack's prefix so that runs never share keys.
func seedTask(m *kvcore.Model, prefix, engine, req string, table kvcore.BlockTable) kvcore.SaveTask {
	hashes := kvcore.HashChain(make([]uint32, 32), m.HashBlockSize, []byte(prefix+req))
	return kvcore.SaveTask{Schema: kvcore.SchemaSaveTask, TaskID: engine + "/" + req + "/save/1", EngineID: engine,
		RequestID: req, Model: m.Name, Start: 0, End: 32, BlockTable: table,
		BlockHashes: []string{hashes[0].Hex(), hashes[1].Hex()}, Groups: m.SaveGroups(0, 32)}
}

// lateTasks are the two saves of the engine whose worker starts mid-test.
func lateTasks(m *kvcore.Model, prefix string) []kvcore.SaveTask {
	var out []kvcore.SaveTask
	for i := range 2 {
		b := kvcore.BlockID(2 * i)
		out = append(out, seedTask(m, prefix, cliLateEngine, fmt.Sprintf("late-%d", i), kvcore.BlockTable{{b, b + 1}, {b, b + 1}}))
	}
	return out
}

// writeTaskBlocks writes random bytes into the blocks the task's chunks
// name, each with its chunk's identity, as the engine's compute would: the
// worker stores only blocks that hold the chunk a put names.
func writeTaskBlocks(t *testing.T, s *cliStack, workerURL string, m *kvcore.Model, task kvcore.SaveTask) {
	t.Helper()
	var blocks []dataplane.Block
	for _, gc := range task.Groups {
		if gc.Group >= len(task.BlockTable) {
			continue // the seed bug's missing group: nothing to write
		}
		for _, c := range gc.Chunks {
			data := make([]byte, m.Groups[gc.Group].BytesPerBlock)
			_, _ = rand.Read(data)
			blocks = append(blocks, dataplane.Block{
				BlockRef: dataplane.BlockRef{Group: gc.Group, Block: task.BlockTable[gc.Group][c.BlockIndex(m.Groups[gc.Group].BlockSize)]},
				Identity: dataplane.Identity{Hash: task.BlockHashes[c.HashIndex(m.HashBlockSize)], RequestID: task.RequestID},
				Data:     data,
			})
		}
	}
	if err := s.mesh.EngineClient(t, workerURL, task.EngineID).Write(context.Background(), blocks); err != nil {
		t.Fatal(err)
	}
}

// dlqIDs are the seeded dead letters' ids by reason.
type dlqIDs map[string][]int64

// seedDeadLetters publishes three saves whose block table lacks group 1
// (the seed bug: group 1 dead-lettered table_group_count, group 0 stored),
// two valid saves of an engine without a worker (both groups dead-lettered
// put_failed once the retries run out) and one garbage record
// (undecodable), and waits until the sender lists the 8 dead letters.
func seedDeadLetters(t *testing.T, s *cliStack) dlqIDs {
	t.Helper()
	m, err := kvcore.Preset("hybrid-mla-linear")
	if err != nil {
		t.Fatal(err)
	}
	var msgs []bus.Message
	add := func(task kvcore.SaveTask) {
		v, err := json.Marshal(task)
		if err != nil {
			t.Fatal(err)
		}
		msgs = append(msgs, bus.Message{Topic: contract.TopicSaveTasks, Key: task.RequestID, Value: v})
	}
	for i := range 3 {
		task := seedTask(m, s.prefix, cliEngine, fmt.Sprintf("seed-%d", i), kvcore.BlockTable{{kvcore.BlockID(2 * i), kvcore.BlockID(2*i + 1)}})
		writeTaskBlocks(t, s, s.url("gpuworker"), m, task) // group 0 is stored from proven blocks
		add(task)
	}
	for _, task := range lateTasks(m, s.prefix) {
		add(task)
	}
	msgs = append(msgs, bus.Message{Topic: contract.TopicSaveTasks, Key: "garbage", Value: []byte("\x00not a save task")})
	s.publish(msgs...)

	ids := dlqIDs{}
	eventually(t, "8 dead letters", func() bool {
		var p page[deadLetter]
		s.getJSON(s.url("sender")+"/v1/dlq?limit=1000", &p)
		clear(ids)
		for _, d := range p.Items {
			ids[string(d.Reason)] = append(ids[string(d.Reason)], d.ID)
		}
		return len(p.Items) == 8
	})
	if len(ids["table_group_count"]) != 3 || len(ids["put_failed"]) != 4 || len(ids["undecodable"]) != 1 {
		t.Fatalf("dead letters by reason %v, want 3 table_group_count, 4 put_failed, 1 undecodable", ids)
	}
	return ids
}

func (r cliRun) ids(t *testing.T) []int64 {
	t.Helper()
	var out []int64
	for _, f := range r.rows() {
		id, err := strconv.ParseInt(f[0], 10, 64)
		if err != nil {
			t.Fatalf("row %q does not start with an id", f)
		}
		out = append(out, id)
	}
	return out
}

func testDLQList(t *testing.T, s *cliStack, ids dlqIDs) {
	flags := s.flags()
	all := runCLI(t, append([]string{"dlq", "list"}, flags...)...).ok(t)
	if !strings.HasPrefix(all.stdout, "ID") || len(all.ids(t)) != 8 || strings.Contains(all.stdout, "next cursor") {
		t.Fatalf("dlq list: want a table of 8 rows and no cursor")
	}
	for _, want := range []string{"table_group_count", "put_failed", "undecodable", cliEngine + "/seed-0/save/1", "record"} {
		if !strings.Contains(all.stdout, want) {
			t.Errorf("dlq list lacks %q", want)
		}
	}

	first := runCLI(t, append([]string{"dlq", "list", "--limit", "3"}, flags...)...).ok(t)
	_, cursor, found := strings.Cut(strings.TrimSpace(first.stdout), "next cursor: ")
	if len(first.ids(t)) != 3 || !found {
		t.Fatalf("--limit 3: want 3 rows and a next cursor")
	}
	second := runCLI(t, append([]string{"dlq", "list", "--limit", "3", "--cursor", cursor}, flags...)...).ok(t)
	if got := append(first.ids(t), second.ids(t)...); !slices.Equal(got, all.ids(t)[:6]) {
		t.Fatalf("two pages gave %v, want %v", got, all.ids(t)[:6])
	}

	paged := runCLI(t, append([]string{"dlq", "list", "--all", "--limit", "3"}, flags...)...).ok(t)
	if !slices.Equal(paged.ids(t), all.ids(t)) || !strings.Contains(paged.stderr, "page 1, 3 dead letters so far") ||
		!strings.Contains(paged.stderr, "3 pages, 8 dead letters") {
		t.Fatalf("--all: want every row and a progress line per page")
	}

	js := runCLI(t, append([]string{"dlq", "list", "--reason", "undecodable", "--json"}, flags...)...).ok(t)
	var p page[deadLetter]
	if err := json.Unmarshal([]byte(js.stdout), &p); err != nil || len(p.Items) != 1 || p.Items[0].ID != ids["undecodable"][0] {
		t.Fatalf("--json --reason undecodable: %v %+v", err, p)
	}

	runCLI(t, append([]string{"dlq", "list", "--limit", "1001"}, flags...)...).fails(t, `Bad Request: limit "1001" must be an integer from 1 to 1000`)
	runCLI(t, "dlq", "list", "--sender-url", "http://127.0.0.1:1").fails(t, "sender at http://127.0.0.1:1 is not reachable",
		"set --sender-url or KVMESH_SENDER_URL")
}

func testDLQShow(t *testing.T, s *cliStack, ids dlqIDs) {
	id := strconv.FormatInt(ids["table_group_count"][0], 10)
	r := runCLI(t, append([]string{"dlq", "show", id}, s.flags()...)...).ok(t)
	for _, want := range []string{"table_group_count", "block table has 1 group", "payload (JSON):", `"schema": "kvmesh.save_task.v1"`, "none (0 attempts)"} {
		if !strings.Contains(r.stdout, want) {
			t.Errorf("dlq show lacks %q", want)
		}
	}
	garbage := runCLI(t, append([]string{"dlq", "show", strconv.FormatInt(ids["undecodable"][0], 10)}, s.flags()...)...).ok(t)
	if !strings.Contains(garbage.stdout, `not JSON): "\x00not a save task"`) {
		t.Errorf("show of the garbage record does not quote its payload")
	}
	js := runCLI(t, append([]string{"dlq", "show", id, "--json"}, s.flags()...)...).ok(t)
	var d deadLetter
	if err := json.Unmarshal([]byte(js.stdout), &d); err != nil || strconv.FormatInt(d.ID, 10) != id || len(d.Payload) == 0 {
		t.Fatalf("show --json: %v %+v", err, d)
	}
	runCLI(t, append([]string{"dlq", "show", "999999"}, s.flags()...)...).fails(t, "Not Found: ")
}

func testTokenErrors(t *testing.T, s *cliStack, ids dlqIDs) {
	id := strconv.FormatInt(ids["put_failed"][0], 10)
	runCLI(t, append([]string{"dlq", "replay", id}, s.tokenless()...)...).
		fails(t, "Unauthorized: this route needs an Authorization: Bearer", "pass --token or set KVMESH_ADMIN_TOKEN")
	runCLI(t, append([]string{"dlq", "replay", id, "--dry-run", "--token", "guess"}, s.tokenless()...)...).
		fails(t, "Unauthorized: auth: not authenticated: the token is neither the operator token nor a signed token", "pass --token or set KVMESH_ADMIN_TOKEN")
	var d deadLetter
	s.getJSON(s.url("sender")+"/v1/dlq/"+id, &d)
	if d.ReplayCount != 0 {
		t.Fatalf("a refused replay was recorded: %+v", d)
	}
}

func testReplayInvalid(t *testing.T, s *cliStack, ids dlqIDs) {
	admin := append(s.flags(), "--token", cliToken)
	dry := runCLI(t, append([]string{"dlq", "replay", "--reason", "table_group_count", "--dry-run"}, admin...)...).ok(t)
	if strings.Count(dry.stdout, "not replayable") != 4 || // three rows and the summary
		!strings.Contains(dry.stdout, "dry run: 3 dead letter(s), 0 would replay, 0 would fail, 3 not replayable") {
		t.Fatalf("dry run of the invalid entries")
	}
	id := strconv.FormatInt(ids["table_group_count"][0], 10)
	r := runCLI(t, append([]string{"dlq", "replay", id}, admin...)...).fails(t, "some replays failed: 1 of 1 dead letters not replayed")
	if !strings.Contains(r.stdout, "still invalid") || !strings.Contains(r.stdout, "Dead letter still invalid") {
		t.Fatalf("replay of an invalid entry: want its outcome on stdout")
	}
	js := runCLI(t, append([]string{"dlq", "replay", id, "999999", "--json"}, admin...)...).fails(t)
	var out struct {
		Results []replayOutcome `json:"results"`
		Summary map[string]int  `json:"summary"`
	}
	if err := json.Unmarshal([]byte(js.stdout), &out); err != nil || len(out.Results) != 2 ||
		out.Summary["still invalid"] != 1 || out.Summary["not found"] != 1 {
		t.Fatalf("--json replay: %v %+v", err, out)
	}
}

func testReplayByReason(t *testing.T, s *cliStack, ids dlqIDs) {
	admin := append(s.flags(), "--token", cliToken)
	before := runCLI(t, append([]string{"dlq", "replay", "--reason", "put_failed", "--dry-run"}, admin...)...).ok(t)
	if !strings.Contains(before.stdout, "dry run: 4 dead letter(s), 0 would replay, 4 would fail") ||
		!strings.Contains(before.stdout, "put_failed: no worker to put the missing keys") {
		t.Fatalf("dry run without the engine's worker: want 4 that would fail for want of a worker")
	}
	s.start("gpuworker-late", "gpuworker", "KVMESH_ENGINE_ID="+cliLateEngine)
	if t.Failed() {
		t.FailNow()
	}
	m, err := kvcore.Preset("hybrid-mla-linear")
	if err != nil {
		t.Fatal(err)
	}
	for _, task := range lateTasks(m, s.prefix) {
		writeTaskBlocks(t, s, s.url("gpuworker-late"), m, task) // the engine computed them once its worker was up
	}
	after := runCLI(t, append([]string{"dlq", "replay", "--reason", "put_failed", "--dry-run"}, admin...)...).ok(t)
	if !strings.Contains(after.stdout, "dry run: 4 dead letter(s), 4 would replay") ||
		strings.Count(after.stdout, "key(s) to put, 0 already present") != 4 {
		t.Fatalf("dry run with the worker up: want 4 that would replay, one key each")
	}
	var d deadLetter
	s.getJSON(fmt.Sprintf("%s/v1/dlq/%d", s.url("sender"), ids["put_failed"][0]), &d)
	if d.ReplayStatus != "none" || d.ReplayCount != 0 {
		t.Fatalf("dry runs changed the entry: %+v", d)
	}

	r := runCLI(t, append([]string{"dlq", "replay", "--reason", "put_failed"}, admin...)...).ok(t)
	replayed := 0
	for _, f := range r.rows() {
		if f[1] == "put_failed" && f[2] == "replayed" && f[3] == "status" && f[4] == "stored:" {
			replayed++
		}
	}
	if replayed != 4 || !strings.Contains(r.stdout, "replay: 4 dead letter(s), 4 replayed, 0 already replayed, 0 still invalid, 0 failed") {
		t.Fatalf("replay by reason: want 4 replayed entries and the summary")
	}
	again := runCLI(t, append([]string{"dlq", "replay", strconv.FormatInt(ids["put_failed"][1], 10)}, admin...)...).ok(t)
	if !strings.Contains(again.stdout, "already replayed") {
		t.Fatalf("second replay: want already replayed")
	}
	js := runCLI(t, append([]string{"dlq", "list", "--reason", "put_failed", "--json"}, s.flags()...)...).ok(t)
	var p page[deadLetter]
	if err := json.Unmarshal([]byte(js.stdout), &p); err != nil || len(p.Items) != 4 {
		t.Fatalf("list after replay: %v %+v", err, p)
	}
	for _, d := range p.Items {
		if d.ReplayStatus != "replayed" || d.ReplayCount != 1 {
			t.Errorf("entry %d after replay: %s, %d attempts", d.ID, d.ReplayStatus, d.ReplayCount)
		}
	}
}
