package main

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/kvmesh/kvmesh/pkg/adminapi"
	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// seedRequests publishes one engine step record of cliReqEngine admitting
// three requests and waits until the scheduler tracks them.
func seedRequests(t *testing.T, s *cliStack) {
	t.Helper()
	m, err := kvcore.Preset("hybrid-mla-linear")
	if err != nil {
		t.Fatal(err)
	}
	step := contract.EngineStep{Schema: contract.SchemaEngineStep, StepID: cliReqEngine + "/cli/1",
		EngineID: cliReqEngine, Model: m.Name, Step: 1}
	for i := range 3 {
		req := fmt.Sprintf("req-%d", i)
		var hexes []string
		for _, h := range kvcore.HashChain(make([]uint32, 48), m.HashBlockSize, []byte(s.prefix+req)) {
			hexes = append(hexes, h.Hex())
		}
		step.Requests = append(step.Requests, contract.RequestEvent{RequestID: req, Seq: 1, Kind: contract.EventAdmitted,
			PromptTokens: 48, BlockHashes: hexes})
	}
	v, err := json.Marshal(step)
	if err != nil {
		t.Fatal(err)
	}
	msgs := []bus.Message{{Topic: contract.TopicEngineSteps, Key: cliReqEngine, Value: v}}
	s.publish(msgs...)
	eventually(t, "3 request trackers", func() bool {
		var p page[adminapi.RequestSummary]
		s.getJSON(s.url("scheduler")+"/v1/requests?engine_id="+cliReqEngine, &p)
		return len(p.Items) == 3
	})
}

func testRequests(t *testing.T, s *cliStack) {
	flags := append(s.flags(), "--engine", cliReqEngine)
	list := runCLI(t, append([]string{"requests", "list"}, flags...)...).ok(t)
	rows := list.rows()
	if len(rows) != 3 || rows[0][0] != cliReqEngine || rows[0][1] != "req-0" || rows[0][2] != "waiting" || rows[2][1] != "req-2" {
		t.Fatalf("requests list rows %q, want req-0..2 waiting", rows)
	}
	first := runCLI(t, append([]string{"requests", "list", "--limit", "2"}, flags...)...).ok(t)
	_, cursor, found := strings.Cut(first.stdout, "next cursor: ")
	if len(first.rows()) != 2 || !found {
		t.Fatalf("--limit 2: want 2 rows and a cursor")
	}
	rest := runCLI(t, append([]string{"requests", "list", "--cursor", strings.TrimSpace(cursor)}, flags...)...).ok(t)
	if r := rest.rows(); len(r) != 1 || r[0][1] != "req-2" {
		t.Fatalf("page after the cursor: %q, want req-2", r)
	}
	all := runCLI(t, append([]string{"requests", "list", "--all", "--limit", "1", "--json"}, flags...)...).ok(t)
	var p page[adminapi.RequestSummary]
	if err := json.Unmarshal([]byte(all.stdout), &p); err != nil || len(p.Items) != 3 || !strings.Contains(all.stderr, "3 pages, 3 requests") {
		t.Fatalf("--all --json: %v %+v", err, p)
	}
	if none := runCLI(t, append([]string{"requests", "list", "--state", "done"}, flags...)...).ok(t); len(none.rows()) != 0 {
		t.Fatalf("--state done: want no rows")
	}
	runCLI(t, append([]string{"requests", "list", "--state", "sleeping"}, flags...)...).fails(t, `Bad Request: state "sleeping" is not one of`)

	show := runCLI(t, append([]string{"requests", "show", cliReqEngine, "req-1"}, s.flags()...)...).ok(t)
	for _, want := range []string{"request            req-1", "state              waiting", "last seq           1", "GROUP"} {
		if !strings.Contains(show.stdout, want) {
			t.Errorf("requests show lacks %q", want)
		}
	}
	js := runCLI(t, append([]string{"requests", "show", cliReqEngine, "req-1", "--json"}, s.flags()...)...).ok(t)
	var d adminapi.RequestDetail
	if err := json.Unmarshal([]byte(js.stdout), &d); err != nil || d.RequestID != "req-1" || d.Tracker == nil {
		t.Fatalf("show --json: %v %+v", err, d)
	}
	runCLI(t, append([]string{"requests", "show", cliReqEngine, "nope"}, s.flags()...)...).fails(t, `Not Found: no tracker for request "nope"`)
}
