package deploy

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
)

// Dashboard is the part of a Grafana dashboard JSON model the checks read.
type Dashboard struct {
	// File is the dashboard's path relative to the repository root.
	File string `json:"-"`
	// UID is the dashboard's stable id.
	UID string `json:"uid"`
	// Title is the dashboard's title.
	Title string `json:"title"`
	// SchemaVersion is the JSON model's version.
	SchemaVersion int `json:"schemaVersion"`
	// Panels are the top-level panels; rows hold further panels.
	Panels []Panel `json:"panels"`
	// Links are the links in the dashboard's header.
	Links []Link `json:"links"`
	// Templating holds the dashboard variables.
	Templating struct {
		// List are the variables.
		List []Variable `json:"list"`
	} `json:"templating"`
}

// AllPanels returns every panel, those inside collapsed rows included.
func (d *Dashboard) AllPanels() []Panel {
	var out []Panel
	for _, p := range d.Panels {
		out = append(out, p)
		out = append(out, p.Panels...)
	}
	return out
}

// Panel is one dashboard panel.
type Panel struct {
	// ID is unique within the dashboard.
	ID int `json:"id"`
	// Title is the panel's title.
	Title string `json:"title"`
	// Type is the visualisation (timeseries, stat, table, row, ...).
	Type string `json:"type"`
	// GridPos places the panel on the dashboard's 24-column grid.
	GridPos GridPos `json:"gridPos"`
	// Datasource is the panel's data source; nil for rows and text.
	Datasource *DatasourceRef `json:"datasource"`
	// Targets are the panel's queries.
	Targets []Target `json:"targets"`
	// Panels are a collapsed row's panels.
	Panels []Panel `json:"panels"`
	// Links are the panel's links (its header's link menu).
	Links []Link `json:"links"`
}

// Link is a dashboard link (type "link" or "dashboards") or a panel link
// (no type).
type Link struct {
	// Title is the link's text.
	Title string `json:"title"`
	// Type is "link" (to URL) or "dashboards" (to dashboards by tag) for a
	// dashboard link; empty for a panel link, which is always a URL.
	Type string `json:"type"`
	// URL is the target; dashboard variables in it are interpolated.
	URL string `json:"url"`
	// TargetBlank opens the link in a new tab.
	TargetBlank bool `json:"targetBlank"`
}

// GridPos is a panel's place: column x and row y of its top left cell,
// its width w (of 24 columns) and height h.
type GridPos struct {
	// X is the first column (0-23).
	X int `json:"x"`
	// Y is the first row.
	Y int `json:"y"`
	// W is the width in columns.
	W int `json:"w"`
	// H is the height in rows.
	H int `json:"h"`
}

// Overlaps reports whether two places share a cell.
func (g GridPos) Overlaps(o GridPos) bool {
	return g.X < o.X+o.W && o.X < g.X+g.W && g.Y < o.Y+o.H && o.Y < g.Y+g.H
}

// DatasourceRef names a data source by type and uid.
type DatasourceRef struct {
	// Type is the plugin id (prometheus, tempo).
	Type string `json:"type"`
	// UID is the provisioned data source uid.
	UID string `json:"uid"`
}

// Target is one query of a panel.
type Target struct {
	// RefID names the query within the panel.
	RefID string `json:"refId"`
	// Datasource overrides the panel's data source when set.
	Datasource *DatasourceRef `json:"datasource"`
	// Expr is a Prometheus query.
	Expr string `json:"expr"`
	// Query is a Tempo (TraceQL) query.
	Query string `json:"query"`
	// QueryType is the Tempo query's kind: "traceql" for a TraceQL search
	// (or a trace id), "traceqlSearch" for the query builder, ...
	QueryType string `json:"queryType"`
	// TableType is how a Tempo search is tabled: "traces" (one row per
	// trace, its matching spans nested) or "spans".
	TableType string `json:"tableType"`
}

// Variable is one dashboard variable.
type Variable struct {
	// Name is the variable's name.
	Name string `json:"name"`
	// Type is query, custom, interval, ...
	Type string `json:"type"`
	// Datasource is a query variable's data source.
	Datasource *DatasourceRef `json:"datasource"`
	// Query is the variable's query: a string or an object with a "query" field.
	Query json.RawMessage `json:"query"`
}

// QueryText returns a query variable's query text.
func (v *Variable) QueryText() string {
	var s string
	if json.Unmarshal(v.Query, &s) == nil {
		return s
	}
	var obj struct {
		Query string `json:"query"`
	}
	if json.Unmarshal(v.Query, &obj) == nil {
		return obj.Query
	}
	return ""
}

// LoadDashboards parses every *.json under root's dashboards directory,
// sorted by file name.
func LoadDashboards(root string) ([]Dashboard, error) {
	files, err := filepath.Glob(filepath.Join(root, DashboardsDir, "*.json"))
	if err != nil {
		return nil, err
	}
	slices.Sort(files)
	out := make([]Dashboard, 0, len(files))
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			return nil, err
		}
		var d Dashboard
		if err := json.Unmarshal(data, &d); err != nil {
			return nil, fmt.Errorf("%s: %w", f, err)
		}
		d.File, _ = filepath.Rel(root, f)
		out = append(out, d)
	}
	return out, nil
}

// Expressions returns every Prometheus query of the dashboard: the panel
// targets with an expr and the query variables on a Prometheus source.
func (d *Dashboard) Expressions() []string {
	var out []string
	for _, p := range d.AllPanels() {
		for _, t := range p.Targets {
			if t.Expr != "" {
				out = append(out, t.Expr)
			}
		}
	}
	for _, v := range d.Templating.List {
		if v.Type == "query" && (v.Datasource == nil || v.Datasource.Type == "prometheus") {
			if q := v.QueryText(); q != "" {
				out = append(out, q)
			}
		}
	}
	return out
}

// DashboardMetrics returns the sorted metric family names that root's
// dashboards query, with the _bucket, _sum and _count series suffixes
// removed so they name the families the code registers.
func DashboardMetrics(root string) ([]string, error) {
	dashboards, err := LoadDashboards(root)
	if err != nil {
		return nil, err
	}
	var names []string
	for _, d := range dashboards {
		for _, expr := range d.Expressions() {
			names = append(names, MetricNames(expr)...)
		}
	}
	for i, n := range names {
		names[i] = Family(n)
	}
	slices.Sort(names)
	return slices.Compact(names), nil
}

// Family returns the metric family of a series name: name without a
// histogram's or summary's _bucket, _sum or _count suffix.
func Family(name string) string {
	for _, suffix := range []string{"_bucket", "_sum", "_count"} {
		if s, ok := strings.CutSuffix(name, suffix); ok {
			return s
		}
	}
	return name
}
