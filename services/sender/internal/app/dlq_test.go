package app_test

import (
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"testing"

	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/deadletter"
	"github.com/kvmesh/kvmesh/pkg/deadletter/dlqhttp"
	"github.com/kvmesh/kvmesh/pkg/httpserver"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/services/sender/internal/api"
)

const adminToken = "test-token" // servicetest.Env.Common's

func TestDLQAdmin(t *testing.T) {
	s := newStack(t, stackOptions{engines: []string{"e1"}})
	other := s.task(t, "e2", "a1", 0, 32, 0)
	other.Model = "other-model"
	noTable := s.task(t, "e1", "a2", 0, 32, 0)
	noTable.BlockTable = kvcore.BlockTable{}
	nullBlock := s.task(t, "e1", "a3", 0, 32, 4)
	nullBlock.BlockTable[1][1] = kvcore.NullBlock
	late := s.task(t, "e-late", "a4", 0, 32, 8) // its gpuworker starts later
	garbage := []byte("\x00not a task")
	s.publish(t, other, noTable, nullBlock, late)
	s.publishRaw(t, bus.Message{Topic: contract.TopicSaveTasks, Key: "junk", Value: garbage})
	for _, task := range []*kvcore.SaveTask{other, noTable, nullBlock, late} {
		s.got.result(t, task.TaskID)
	}
	var all dlqhttp.Page
	poll(t, "8 dead letters", func() bool {
		s.do(t, http.MethodGet, "/v1/dlq", "", &all)
		return len(all.Items) == 8
	})
	ids := func(p dlqhttp.Page) []int64 {
		var out []int64
		for _, e := range p.Items {
			out = append(out, e.ID)
		}
		return out
	}
	if !slices.IsSortedFunc(ids(all), func(a, b int64) int { return int(b - a) }) || all.NextCursor != "" {
		t.Fatalf("list not newest first or has a cursor: %v %q", ids(all), all.NextCursor)
	}
	byID := map[int64]deadletter.Entry{}
	for _, e := range all.Items {
		byID[e.ID] = e
		if e.Payload != nil || e.PayloadBytes == 0 {
			t.Fatalf("list entry %d carries its payload or no size", e.ID)
		}
	}
	find := func(request, reason string) deadletter.Entry {
		for _, e := range all.Items {
			if e.RequestID == request && string(e.Reason) == reason {
				return e
			}
		}
		t.Fatalf("no dead letter %s/%s in %+v", request, reason, all.Items)
		return deadletter.Entry{}
	}

	t.Run("filters", func(t *testing.T) {
		cases := []struct {
			query string
			want  int
		}{
			{"reason=model_unknown", 2}, {"engine_id=e1", 3}, {"request_id=a3", 1},
			{"reason=table_group_count&engine_id=e1", 2}, {"reason=put_failed&request_id=a4", 2},
			{"reason=undecodable", 1}, {"engine_id=nobody", 0},
		}
		for _, tc := range cases {
			var p dlqhttp.Page
			if code := s.do(t, http.MethodGet, "/v1/dlq?"+tc.query, "", &p); code != http.StatusOK || len(p.Items) != tc.want {
				t.Errorf("?%s: %d, %d items, want %d", tc.query, code, len(p.Items), tc.want)
			}
		}
	})

	t.Run("pagination", func(t *testing.T) {
		var seen []int64
		cursor := ""
		for pages := 0; ; pages++ {
			if pages == 5 {
				t.Fatal("pagination does not end")
			}
			var p dlqhttp.Page
			if code := s.do(t, http.MethodGet, "/v1/dlq?limit=3&cursor="+cursor, "", &p); code != http.StatusOK {
				t.Fatalf("page %d: %d", pages, code)
			}
			seen = append(seen, ids(p)...)
			if p.NextCursor == "" {
				break
			}
			cursor = p.NextCursor
		}
		if !slices.Equal(seen, ids(all)) {
			t.Fatalf("pages gave %v, want %v", seen, ids(all))
		}
		// A last page that is exactly full has no cursor either.
		var full dlqhttp.Page
		if code := s.do(t, http.MethodGet, fmt.Sprintf("/v1/dlq?limit=%d", len(all.Items)), "", &full); code != http.StatusOK ||
			len(full.Items) != len(all.Items) || full.NextCursor != "" {
			t.Fatalf("exactly full page: %d, %d items, cursor %q; want every item and no cursor", code, len(full.Items), full.NextCursor)
		}
		for _, q := range []string{"limit=0", "limit=1001", "limit=x", "cursor=abc"} {
			var prob httpserver.Problem
			code := s.do(t, http.MethodGet, "/v1/dlq?"+q, "", &prob)
			param := q[:len("limit")]
			if q[0] == 'c' {
				param = "cursor"
			}
			if code != http.StatusBadRequest || prob.Extras["parameter"] != param {
				t.Errorf("?%s: %d %+v, want 400 naming %s", q, code, prob, param)
			}
		}
	})

	t.Run("show", func(t *testing.T) {
		var e deadletter.Entry
		junk := find("", "undecodable")
		if code := s.do(t, http.MethodGet, fmt.Sprintf("/v1/dlq/%d", junk.ID), "", &e); code != http.StatusOK ||
			string(e.Payload) != string(garbage) || e.PayloadJSON != nil || e.Topic != contract.TopicSaveTasks {
			t.Fatalf("show undecodable: %d %+v", code, e)
		}
		nb := find("a3", "null_block")
		if code := s.do(t, http.MethodGet, fmt.Sprintf("/v1/dlq/%d", nb.ID), "", &e); code != http.StatusOK || *e.Group != 1 {
			t.Fatalf("show null_block: %d %+v", code, e)
		}
		var task kvcore.SaveTask
		if err := json.Unmarshal(e.PayloadJSON, &task); err != nil || task.TaskID != nullBlock.TaskID {
			t.Fatalf("payload_json %s: %v", e.PayloadJSON, err)
		}
		for path, want := range map[string]int{"/v1/dlq/999999": http.StatusNotFound, "/v1/dlq/abc": http.StatusBadRequest} {
			if code := s.do(t, http.MethodGet, path, "", nil); code != want {
				t.Errorf("GET %s = %d, want %d", path, code, want)
			}
		}
	})

	t.Run("replay", func(t *testing.T) {
		nb := find("a3", "null_block")
		path := fmt.Sprintf("/v1/dlq/%d/replay", nb.ID)
		for token, want := range map[string]int{"": http.StatusUnauthorized, "wrong": http.StatusUnauthorized} {
			if code := s.do(t, http.MethodPost, path, token, nil); code != want {
				t.Errorf("replay with token %q = %d, want %d", token, code, want)
			}
		}
		for _, e := range []deadletter.Entry{nb, find("", "undecodable")} {
			var prob httpserver.Problem
			code := s.do(t, http.MethodPost, fmt.Sprintf("/v1/dlq/%d/replay", e.ID), adminToken, &prob)
			if code != http.StatusUnprocessableEntity || prob.Extras["reason"] != string(e.Reason) {
				t.Errorf("replay of still-invalid %s: %d %+v", e.Reason, code, prob)
			}
		}

		// The engine's gpuworker appears: the put_failed entry replays.
		s.startWorker(t, "e-late")
		s.writeBlocks(t, late)
		entry := find("a4", "put_failed")
		path = fmt.Sprintf("/v1/dlq/%d/replay", entry.ID)
		var first, second deadletter.ReplayAnswer
		if code := s.do(t, http.MethodPost, path, adminToken, &first); code != http.StatusOK ||
			first.ReplayStatus != "replayed" || first.AlreadyReplayed || first.Result.Status != "stored" {
			t.Fatalf("replay: %d %+v", code, first)
		}
		g := *entry.Group
		s.checkStored(t, late, g)
		if code := s.do(t, http.MethodPost, path, adminToken, &second); code != http.StatusOK || !second.AlreadyReplayed ||
			second.ReplayCount != 1 || second.Result.Groups[0] != first.Result.Groups[0] {
			t.Fatalf("second replay: %d %+v, want the recorded result", code, second)
		}
		var shown deadletter.Entry
		s.do(t, http.MethodGet, fmt.Sprintf("/v1/dlq/%d", entry.ID), "", &shown)
		if shown.ReplayStatus != "replayed" || shown.ReplayCount != 1 {
			t.Fatalf("entry after replay %+v", shown)
		}
		// Only that group was stored.
		if s.missing(t, s.keys(t, late, 1-g)) == 0 {
			t.Fatalf("group %d was stored by a replay of group %d", 1-g, g)
		}
		s.checkMetrics(t, `kvmesh_dlq_replays_total{result="replayed"} 1`, `kvmesh_dlq_replays_total{result="already"} 1`,
			`kvmesh_dlq_replays_total{result="failed"} 0`)
	})

	t.Run("stats", func(t *testing.T) {
		var st api.Stats
		if code := s.do(t, http.MethodGet, "/v1/stats", "", &st); code != http.StatusOK {
			t.Fatalf("stats %d", code)
		}
		if st.DeadLetters["total"] != 8 || st.DeadLetters["model_unknown"] != 2 || st.Tasks["total"] != 4 ||
			st.Tasks["failed"] != 1 || st.Tasks["dead_lettered"] != 3 || st.Groups["stored"] != 1 || st.Bytes == 0 {
			t.Fatalf("stats %+v", st)
		}
	})
}
