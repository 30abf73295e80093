package deploy_test

import (
	"maps"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/kvmesh/kvmesh/deploy"
	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/telemetry"
)

// requestIDVariable is the mesh overview's variable holding the request id
// to find the trace of.
const requestIDVariable = "request_id"

// requestTraceDashboard is the dashboard that leads from the mesh to a
// request's trace.
const requestTraceDashboard = "mesh-overview.json"

// simDir holds the simulator, whose sim.turn span is a request's root.
const simDir = "internal/sim"

// loadDashboard returns the dashboard of file name under DashboardsDir.
func loadDashboard(t *testing.T, root, name string) deploy.Dashboard {
	t.Helper()
	dashboards, err := deploy.LoadDashboards(root)
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range dashboards {
		if filepath.Base(d.File) == name {
			return d
		}
	}
	t.Fatalf("no dashboard %s", name)
	return deploy.Dashboard{}
}

// checkRequestSearch checks that a Tempo query target is a TraceQL search
// for spans whose attribute equals the request id variable, and returns
// the attribute's name.
func checkRequestSearch(t *testing.T, where string, tg deploy.Target) string {
	t.Helper()
	if tg.QueryType != "traceql" {
		t.Errorf("%s: queryType %q, want traceql (a TraceQL search)", where, tg.QueryType)
	}
	scope, attr, value, err := deploy.TraceQLEquality(tg.Query)
	if err != nil {
		t.Errorf("%s: %v", where, err)
		return ""
	}
	if scope != "span" {
		t.Errorf("%s: %q searches scope %q, want span (the services set it on spans, not the resource)", where, tg.Query, scope)
	}
	if v, ok := deploy.VariableRef(value); !ok || v != requestIDVariable {
		t.Errorf("%s: %q compares %s with %q, want the variable $%s", where, tg.Query, attr, value, requestIDVariable)
	}
	return attr
}

// requestTracePanels returns the dashboard's panels with a TraceQL query
// on the Tempo data source, and the attributes those queries compare with
// the request id.
func requestTracePanels(t *testing.T, d deploy.Dashboard) ([]deploy.Panel, []string) {
	t.Helper()
	var panels []deploy.Panel
	var attrs []string
	for _, p := range d.AllPanels() {
		for _, tg := range p.Targets {
			ds := tg.Datasource
			if ds == nil {
				ds = p.Datasource
			}
			if ds == nil || ds.UID != "tempo" {
				continue
			}
			if ds.Type != "tempo" {
				t.Errorf("%s: panel %q: data source uid tempo of type %q", d.File, p.Title, ds.Type)
			}
			attrs = append(attrs, checkRequestSearch(t, d.File+": panel "+p.Title, tg))
			panels = append(panels, p)
		}
	}
	return panels, attrs
}

// TestDeployMeshOverviewRequestTrace checks the mesh overview leads to a
// request's trace: a textbox variable request_id, a panel in the row
// "Request trace" that searches Tempo with TraceQL for the spans whose
// kvmesh.request_id is $request_id and tables the traces (each trace id
// links to the trace view), and a dashboard link, valid Explore URL, that
// opens Explore on Tempo with the same search over the dashboard's time
// range.
func TestDeployMeshOverviewRequestTrace(t *testing.T) {
	root := testenv.ModuleRoot(t)
	d := loadDashboard(t, root, requestTraceDashboard)

	i := slices.IndexFunc(d.Templating.List, func(v deploy.Variable) bool { return v.Name == requestIDVariable })
	if i < 0 {
		t.Fatalf("%s: no variable %s", d.File, requestIDVariable)
	}
	if v := d.Templating.List[i]; v.Type != "textbox" {
		t.Errorf("%s: variable %s is a %q, want a textbox (a request id is typed or passed as var-%s=)", d.File, v.Name, v.Type, v.Name)
	}

	panels, attrs := requestTracePanels(t, d)
	if len(panels) == 0 {
		t.Fatalf("%s: no panel queries the Tempo data source with TraceQL", d.File)
	}
	for _, p := range panels {
		for _, tg := range p.Targets {
			if p.Type != "table" && p.Type != "traces" {
				t.Errorf("%s: panel %q is a %q, want a table of the traces (or traces)", d.File, p.Title, p.Type)
			}
			if p.Type == "table" && tg.TableType != "traces" {
				t.Errorf("%s: panel %q: tableType %q, want traces (a row per trace, its id linking to the trace view)", d.File, p.Title, tg.TableType)
			}
		}
	}
	for _, a := range attrs {
		if a != telemetry.AttrRequestID {
			t.Errorf("%s: the trace search compares %q with $%s, want %s", d.File, a, requestIDVariable, telemetry.AttrRequestID)
		}
	}
	row := -1
	for j, p := range d.Panels {
		if p.Type == "row" && p.Title == "Request trace" {
			row = j
		}
	}
	if row < 0 {
		t.Errorf("%s: no row %q", d.File, "Request trace")
	} else if !slices.ContainsFunc(panels, func(p deploy.Panel) bool { return inRow(d, row, p.ID) }) {
		t.Errorf("%s: the trace search is not in the row %q", d.File, "Request trace")
	}

	var dashboardLinks int
	links := map[string]deploy.Link{}
	for _, l := range d.Links {
		if l.Type == "link" && strings.Contains(l.URL, "/explore") {
			links["dashboard link "+l.Title] = l
			dashboardLinks++
		}
	}
	for _, p := range d.AllPanels() {
		for _, l := range p.Links {
			if strings.Contains(l.URL, "/explore") {
				links["panel "+p.Title+" link "+l.Title] = l
			}
		}
	}
	if dashboardLinks == 0 {
		t.Errorf("%s: no dashboard link to Explore", d.File)
	}
	for _, where := range slices.Sorted(maps.Keys(links)) {
		checkExploreLink(t, d.File+": "+where, links[where].URL)
	}
}

// inRow reports whether the panel of id belongs to the row at index row of
// d.Panels: nested in it (collapsed) or after it and before the next row.
func inRow(d deploy.Dashboard, row, id int) bool {
	if slices.ContainsFunc(d.Panels[row].Panels, func(p deploy.Panel) bool { return p.ID == id }) {
		return true
	}
	for _, p := range d.Panels[row+1:] {
		if p.Type == "row" {
			return false
		}
		if p.ID == id {
			return true
		}
	}
	return false
}

// checkExploreLink checks an Explore link opens one pane on the Tempo data
// source with the dashboard's trace search (a TraceQL search for the spans
// whose telemetry.AttrRequestID is the request id variable, in any of
// Grafana's variable formats), over the dashboard's time range.
func checkExploreLink(t *testing.T, where, raw string) {
	t.Helper()
	panes, err := deploy.ParseExploreURL(raw)
	if err != nil {
		t.Errorf("%s: %v", where, err)
		return
	}
	if len(panes) != 1 {
		t.Errorf("%s: %d panes, want 1", where, len(panes))
	}
	for id, p := range panes {
		where := where + ": pane " + id
		if p.Datasource != "tempo" {
			t.Errorf("%s: data source %q, want tempo", where, p.Datasource)
		}
		if len(p.Queries) != 1 {
			t.Errorf("%s: %d queries, want 1", where, len(p.Queries))
		}
		for _, q := range p.Queries {
			if q.Datasource == nil || q.Datasource.UID != "tempo" || q.Datasource.Type != "tempo" {
				t.Errorf("%s: query %s: data source %+v, want tempo", where, q.RefID, q.Datasource)
			}
			if q.RefID == "" {
				t.Errorf("%s: a query has no refId", where)
			}
			if attr := checkRequestSearch(t, where, q); attr != "" && attr != telemetry.AttrRequestID {
				t.Errorf("%s: the search compares %q with $%s, want %s", where, attr, requestIDVariable, telemetry.AttrRequestID)
			}
		}
		if from, _ := deploy.VariableRef(p.Range.From); from != "__from" {
			t.Errorf("%s: range from %q, want the dashboard's (${__from})", where, p.Range.From)
		}
		if to, _ := deploy.VariableRef(p.Range.To); to != "__to" {
			t.Errorf("%s: range to %q, want the dashboard's (${__to})", where, p.Range.To)
		}
	}
}

// TestDeployRequestTraceAttributeIsOnSpans checks the attribute that the
// dashboards search Tempo for is the one the code puts on spans: every
// service (under services/<program>/) and the simulator, whose sim.turn is
// a request's root span, set telemetry.AttrRequestID as a string with
// OpenTelemetry's attribute package.
func TestDeployRequestTraceAttributeIsOnSpans(t *testing.T) {
	root := testenv.ModuleRoot(t)
	attrs, err := deploy.OTelAttributes(root, "services", simDir, "pkg/telemetry") // pkg/telemetry: the attribute keys' constants
	if err != nil {
		t.Fatal(err)
	}
	d := loadDashboard(t, root, requestTraceDashboard)
	_, searched := requestTracePanels(t, d)
	if len(searched) == 0 {
		t.Fatalf("%s: no trace search", d.File)
	}
	dirs := []string{simDir}
	for _, program := range slices.Sorted(maps.Keys(deploy.ServiceAddrs)) {
		dirs = append(dirs, "services/"+program)
	}
	for _, name := range append(searched, telemetry.AttrRequestID) {
		for _, dir := range dirs {
			var other []string
			found := slices.ContainsFunc(attrs, func(a deploy.OTelAttribute) bool {
				if a.Key != name || !strings.HasPrefix(a.File, dir+"/") {
					return false
				}
				other = append(other, a.Type)
				return a.Type == "String"
			})
			if !found {
				t.Errorf("no Go source under %s sets span attribute %q as a string (attribute.String), which %s searches Tempo for (setters found: %v)", dir, name, d.File, other)
			}
		}
	}
}

func TestParseExploreURL(t *testing.T) {
	const tempoPane = `{"datasource":"tempo","queries":[{"refId":"A","datasource":{"type":"tempo","uid":"tempo"},"queryType":"traceql","query":"{ span.\"k\" = \"v\" }"}],"range":{"from":"now-1h","to":"now"}}`
	esc := func(s string) string {
		return strings.NewReplacer("%", "%25", "&", "%26", "#", "%23", "+", "%2B", " ", "%20").Replace(s)
	}
	for _, tc := range []struct {
		url     string
		wantErr bool
		ids     []string
	}{
		{url: "/explore?schemaVersion=1&orgId=1&panes=" + esc(`{"abc":`+tempoPane+`}`), ids: []string{"abc"}},
		{url: "http://grafana:3000/explore?schemaVersion=1&panes=" + esc(`{"abc":`+tempoPane+`,"xyz":`+tempoPane+`}`), ids: []string{"abc", "xyz"}},
		{url: "/explore?orgId=1&left=" + esc(tempoPane), ids: []string{"left"}},
		{url: "/explore?panes=" + esc(`{"abc":`+tempoPane+`}`), wantErr: true},                                                        // no schemaVersion
		{url: "/d/abc?schemaVersion=1&panes=" + esc(`{"abc":`+tempoPane+`}`), wantErr: true},                                          // not Explore
		{url: "/explore?schemaVersion=1&panes=" + esc(`{"abc":{"datasource":"tempo",}}`), wantErr: true},                              // bad JSON
		{url: "/explore?schemaVersion=1&panes=" + esc(`{"abc":{"datasource":{"uid":"tempo"}}}`), wantErr: true},                       // data source not a uid
		{url: "/explore?schemaVersion=1&panes=" + esc(`{"abc":{"range":{"from":0,"to":"now"}}}`), wantErr: true},                      // range not strings
		{url: "/explore?schemaVersion=1&panes=%zz", wantErr: true},                                                                    // bad escape
		{url: "/explore?orgId=1", wantErr: true},                                                                                      // no pane
		{url: "/explore?schemaVersion=1&panes=" + `{"abc":{"datasource":"tempo","queries":[{"query":"a+b"}]}}`, ids: []string{"abc"}}, // unescaped, as in a browser
	} {
		panes, err := deploy.ParseExploreURL(tc.url)
		if (err != nil) != tc.wantErr {
			t.Errorf("ParseExploreURL(%q): error %v, want error %v", tc.url, err, tc.wantErr)
			continue
		}
		if got := slices.Sorted(maps.Keys(panes)); err == nil && !slices.Equal(got, tc.ids) {
			t.Errorf("ParseExploreURL(%q): panes %v, want %v", tc.url, got, tc.ids)
		}
	}
	panes, err := deploy.ParseExploreURL("/explore?schemaVersion=1&panes=" + esc(`{"abc":`+tempoPane+`}`))
	if err != nil {
		t.Fatal(err)
	}
	p := panes["abc"]
	if p.Datasource != "tempo" || len(p.Queries) != 1 || p.Queries[0].Query != `{ span."k" = "v" }` || p.Queries[0].QueryType != "traceql" ||
		p.Queries[0].Datasource == nil || p.Queries[0].Datasource.UID != "tempo" || p.Range.From != "now-1h" || p.Range.To != "now" {
		t.Errorf("pane %+v", p)
	}
}

func TestTraceQLEquality(t *testing.T) {
	for _, tc := range []struct {
		q, scope, attr, value string
		wantErr               bool
	}{
		{q: `{ span."kvmesh.request_id" = "$request_id" }`, scope: "span", attr: "kvmesh.request_id", value: "$request_id"},
		{q: `{span.kvmesh.request_id="r-1"}`, scope: "span", attr: "kvmesh.request_id", value: "r-1"},
		{q: `{ resource.service.name = "kvmesh-lookup" }`, scope: "resource", attr: "service.name", value: "kvmesh-lookup"},
		{q: `{ .http.route = "/v1/x" }`, attr: "http.route", value: "/v1/x"},
		{q: `{ span."a \"b\"" = "c \"d\"" }`, scope: "span", attr: `a "b"`, value: `c "d"`},
		{q: `{ span.kvmesh.request_id != "x" }`, wantErr: true},
		{q: `{ span.kvmesh.request_id = "x" && span.b = "y" }`, wantErr: true},
		{q: `{ span.kvmesh.request_id = x }`, wantErr: true},
		{q: `span.kvmesh.request_id = "x"`, wantErr: true},
		{q: `{ event.kvmesh.request_id = "x" }`, wantErr: true},
	} {
		scope, attr, value, err := deploy.TraceQLEquality(tc.q)
		if (err != nil) != tc.wantErr || err == nil && (scope != tc.scope || attr != tc.attr || value != tc.value) {
			t.Errorf("TraceQLEquality(%q) = %q, %q, %q, %v; want %q, %q, %q, error %v", tc.q, scope, attr, value, err, tc.scope, tc.attr, tc.value, tc.wantErr)
		}
	}
}

func TestVariableRef(t *testing.T) {
	for in, want := range map[string]string{
		"$request_id": "request_id", "${request_id}": "request_id", "${request_id:percentencode}": "request_id",
		"${__from}": "__from", "request_id": "", "$request_id-x": "", "${request_id": "", "x$request_id": "",
	} {
		got, ok := deploy.VariableRef(in)
		if got != want || ok != (want != "") {
			t.Errorf("VariableRef(%q) = %q, %v; want %q", in, got, ok, want)
		}
	}
}

func TestOTelAttributes(t *testing.T) {
	root := t.TempDir()
	write := func(rel, src string) { writeFile(t, root, rel, src) }
	write("services/a/a.go", `package a

import (
	"go.opentelemetry.io/otel/attribute"
	"example.com/keys"
)

const idKey = "lit.const"

var typedKey = attribute.Key("typed.var")

func f(id string, n int) []attribute.KeyValue {
	return []attribute.KeyValue{
		attribute.String("lit.string", id),
		attribute.Int("lit.int", n),
		attribute.String(idKey, id),
		attribute.String(otherFileKey, id),
		attribute.String(keys.Shared, id),
		attribute.Key("key.chain").String(id),
		typedKey.Bool(true),
		keys.Typed.String(id),
		attribute.StringValue("not.a.key"),
		attribute.String(dynamic(), id),
	}
}
`)
	write("services/a/b.go", `package a

const otherFileKey = "other.file"

func dynamic() string { return "dynamic" }
`)
	write("services/a/a_test.go", `package a

import "go.opentelemetry.io/otel/attribute"

var _ = attribute.String("test.only", "")
`)
	write("pkg/keys/keys.go", `package keys

import otelattr "go.opentelemetry.io/otel/attribute"

const Shared = "shared.const"

const Typed = otelattr.Key("typed.const")
`)
	got, err := deploy.OTelAttributes(root, "services", "pkg")
	if err != nil {
		t.Fatal(err)
	}
	var keys []string
	for _, a := range got {
		keys = append(keys, a.Type+" "+a.Key+" "+a.File)
	}
	slices.Sort(keys)
	want := []string{
		"Bool typed.var services/a/a.go",
		"Int lit.int services/a/a.go",
		"Key key.chain services/a/a.go",
		"Key typed.const pkg/keys/keys.go",
		"Key typed.var services/a/a.go",
		"String key.chain services/a/a.go",
		"String lit.const services/a/a.go",
		"String lit.string services/a/a.go",
		"String other.file services/a/a.go",
		"String shared.const services/a/a.go",
		"String typed.const services/a/a.go",
	}
	if !slices.Equal(keys, want) {
		t.Errorf("OTelAttributes:\n got %q\nwant %q", keys, want)
	}
	if _, err := deploy.OTelAttributes(root, "nothing"); err == nil {
		t.Error("OTelAttributes of a missing directory: no error")
	}
}
