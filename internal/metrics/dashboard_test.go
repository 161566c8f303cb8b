package metrics_test

import (
	"encoding/json"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"

	"github.com/gpushm/gpushm/internal/metrics"
	"github.com/gpushm/gpushm/internal/segment"
	"github.com/gpushm/gpushm/internal/wire"
)

const dashboardPath = "../../deploy/grafana/gpushm.json"

// panel is what the test reads of a Grafana panel.
type panel struct {
	Title   string  `json:"title"`
	Type    string  `json:"type"`
	Panels  []panel `json:"panels"` // a row's
	Targets []struct {
		Expr         string `json:"expr"`
		LegendFormat string `json:"legendFormat"`
	} `json:"targets"`
}

// exported gathers every gpushm metric a daemon with GPUs, segments and
// quotas exports, with its labels.
func exported(t *testing.T) map[string][]string {
	t.Helper()
	src := fakeSource{
		devs: []wire.Device{{Index: 0, Name: "NVIDIA H200", UUID: uuid1, TotalBytes: 1000, FreeBytes: 400}},
		segs: []segment.Info{{ID: 3, Name: "weights", AllocSize: 400, UID: 0, Linked: true, Opens: 1}},
	}
	m := metrics.New("cuda", quotaSource{src})
	m.SetGPUs(func() *wire.GPUReport { return report })
	m.Observe("open", "", time.Millisecond)
	m.ObserveMove("restore", 300, 10*time.Millisecond)
	m.Connected(1)
	mfs, err := m.Registry().Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string][]string{}
	for _, mf := range mfs {
		name := mf.GetName()
		if !strings.HasPrefix(name, "gpushm_") {
			continue
		}
		var labels []string
		for _, l := range mf.GetMetric()[0].GetLabel() {
			labels = append(labels, l.GetName())
		}
		out[name] = labels
		if mf.GetType() == dto.MetricType_HISTOGRAM {
			out[name+"_bucket"] = append(slices.Clone(labels), "le")
			out[name+"_sum"] = labels
			out[name+"_count"] = labels
		}
	}
	return out
}

type quotaSource struct{ fakeSource }

func (quotaSource) Quotas() []segment.QuotaUse {
	return []segment.QuotaUse{{Kind: "user_bytes", Scope: "1000", Used: 1, Limit: 2}}
}

var (
	metricRE   = regexp.MustCompile(`\bgpushm_[a-z0-9_]+`)
	byRE       = regexp.MustCompile(`\b(?:by|without)\s*\(([^)]*)\)`)
	selectorRE = regexp.MustCompile(`\b(gpushm_[a-z0-9_]+)\{([^}]*)\}`)
	matcherRE  = regexp.MustCompile(`([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)`)
	legendRE   = regexp.MustCompile(`\{\{\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\}\}`)
)

// Labels every series has once Prometheus scrapes it.
var targetLabels = []string{"instance", "job"}

// TestDashboard checks that deploy/grafana/gpushm.json is a Grafana
// dashboard whose every query names metrics and labels the daemon exports,
// and that it shows every gpushm metric.
func TestDashboard(t *testing.T) {
	data, err := os.ReadFile(dashboardPath)
	if err != nil {
		t.Fatal(err)
	}
	var dash struct {
		Title      string  `json:"title"`
		UID        string  `json:"uid"`
		Schema     int     `json:"schemaVersion"`
		Panels     []panel `json:"panels"`
		Templating struct {
			List []struct {
				Name       string `json:"name"`
				Type       string `json:"type"`
				Definition string `json:"definition"`
			} `json:"list"`
		} `json:"templating"`
	}
	if err := json.Unmarshal(data, &dash); err != nil {
		t.Fatalf("%s: %v", dashboardPath, err)
	}
	if dash.Title == "" || dash.UID == "" || dash.Schema < 30 || len(dash.Panels) == 0 {
		t.Fatalf("%s does not look like a Grafana dashboard: title %q, uid %q, schemaVersion %d, %d panels",
			dashboardPath, dash.Title, dash.UID, dash.Schema, len(dash.Panels))
	}
	have := exported(t)
	used := map[string]bool{}
	check := func(where, expr, legend string) {
		t.Helper()
		names := metricRE.FindAllString(expr, -1)
		if len(names) == 0 {
			t.Errorf("%s: query %q names no gpushm metric", where, expr)
		}
		labels := slices.Clone(targetLabels)
		for _, n := range names {
			l, ok := have[n]
			if !ok {
				t.Errorf("%s: query %q uses %s, which the daemon does not export", where, expr, n)
				continue
			}
			used[strings.TrimSuffix(strings.TrimSuffix(strings.TrimSuffix(n, "_bucket"), "_sum"), "_count")] = true
			labels = append(labels, l...)
		}
		for _, m := range selectorRE.FindAllStringSubmatch(expr, -1) {
			for _, l := range matcherRE.FindAllStringSubmatch(m[2], -1) {
				if !slices.Contains(append(slices.Clone(targetLabels), have[m[1]]...), l[1]) {
					t.Errorf("%s: query %q selects on %s, a label %s does not have", where, expr, l[1], m[1])
				}
			}
		}
		for _, m := range byRE.FindAllStringSubmatch(expr, -1) {
			for l := range strings.SplitSeq(m[1], ",") {
				if l = strings.TrimSpace(l); l != "" && !slices.Contains(labels, l) {
					t.Errorf("%s: query %q groups by %s, a label none of its metrics has", where, expr, l)
				}
			}
		}
		for _, m := range legendRE.FindAllStringSubmatch(legend, -1) {
			if !slices.Contains(labels, m[1]) {
				t.Errorf("%s: legend %q shows %s, a label none of its metrics has", where, legend, m[1])
			}
		}
	}
	var walk func([]panel)
	queries := 0
	walk = func(ps []panel) {
		for _, p := range ps {
			walk(p.Panels)
			if p.Type != "row" && len(p.Targets) == 0 {
				t.Errorf("panel %q has no query", p.Title)
			}
			for _, q := range p.Targets {
				check("panel "+p.Title, q.Expr, q.LegendFormat)
				queries++
			}
		}
	}
	walk(dash.Panels)
	for _, v := range dash.Templating.List {
		if v.Type == "query" {
			check("variable "+v.Name, v.Definition, "")
		}
	}
	for name := range have {
		if !strings.HasSuffix(name, "_bucket") && !strings.HasSuffix(name, "_sum") && !strings.HasSuffix(name, "_count") && !used[name] {
			t.Errorf("the dashboard does not show %s", name)
		}
	}
	t.Logf("%d panels' queries checked against %d exported metrics", queries, len(have))
}
