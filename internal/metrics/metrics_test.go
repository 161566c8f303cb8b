package metrics_test

import (
	"context"
	"strconv"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/backend"
	"github.com/gpushm/gpushm/internal/metrics"
	"github.com/gpushm/gpushm/internal/segment"
	"github.com/gpushm/gpushm/internal/server"
	"github.com/gpushm/gpushm/internal/testdaemon"
)

func TestMetricsFollowTheDaemon(t *testing.T) {
	var m *metrics.Metrics
	d := testdaemon.StartWith(t, "host", func(s *server.Server, b backend.Backend) {
		m = metrics.New(b.Name(), struct {
			*segment.Registry
			backend.Backend
		}{s.Registry(), b})
		s.SetObserver(m)
	})
	ctx := context.Background()
	c, err := gpushm.Dial(ctx, d.Socket)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	a, err := c.Create(ctx, "a", 5000, nil) // 8192 bytes allocated, one lease
	if err != nil {
		t.Fatal(err)
	}
	b, _, err := c.CreateOnly(ctx, "b", 4096, nil)
	if err != nil {
		t.Fatal(err)
	}
	ida, idb := strconv.FormatUint(a.Info().ID, 10), strconv.FormatUint(b.ID, 10)
	c.Open(ctx, "missing", nil)
	c.Unlink(ctx, "a") // still open: unnamed, holding memory

	uid := "0"
	if u := a.Info().UID; u != 0 {
		t.Skipf("test assumes root, runs as uid %d", u)
	}
	want := `
# HELP gpushm_segment_bytes Bytes allocated to segments, by device, owner and whether a name still points at them.
# TYPE gpushm_segment_bytes gauge
gpushm_segment_bytes{device="0",named="false",uid="` + uid + `",user="root",uuid=""} 8192
gpushm_segment_bytes{device="0",named="true",uid="` + uid + `",user="root",uuid=""} 4096
# HELP gpushm_segments Segments holding memory, by device, owner and whether a name still points at them.
# TYPE gpushm_segments gauge
gpushm_segments{device="0",named="false",uid="` + uid + `",user="root",uuid=""} 1
gpushm_segments{device="0",named="true",uid="` + uid + `",user="root",uuid=""} 1
# HELP gpushm_leases Opens held on segments, by device and owner.
# TYPE gpushm_leases gauge
gpushm_leases{device="0",uid="` + uid + `",user="root",uuid=""} 1
# HELP gpushm_segment_allocated_bytes Bytes allocated to one segment (the largest 1000), with its name (empty once unlinked), id, device and owner.
# TYPE gpushm_segment_allocated_bytes gauge
gpushm_segment_allocated_bytes{device="0",id="` + ida + `",segment="",uid="0",user="root",uuid=""} 8192
gpushm_segment_allocated_bytes{device="0",id="` + idb + `",segment="b",uid="0",user="root",uuid=""} 4096
# HELP gpushm_connections Client connections open now.
# TYPE gpushm_connections gauge
gpushm_connections 1
`
	if err := testutil.GatherAndCompare(m.Registry(), strings.NewReader(want),
		"gpushm_segment_bytes", "gpushm_segments", "gpushm_leases", "gpushm_connections", "gpushm_segment_allocated_bytes"); err != nil {
		t.Fatal(err)
	}
	ops := `
# HELP gpushm_operations_total Requests answered, by operation and result code (OK or an errno name).
# TYPE gpushm_operations_total counter
gpushm_operations_total{code="ENOENT",op="open"} 1
gpushm_operations_total{code="OK",op="create"} 2
gpushm_operations_total{code="OK",op="hello"} 1
gpushm_operations_total{code="OK",op="unlink"} 1
`
	if err := testutil.GatherAndCompare(m.Registry(), strings.NewReader(ops), "gpushm_operations_total"); err != nil {
		t.Fatal(err)
	}
	if n := testutil.CollectAndCount(m.Registry(), "gpushm_operation_duration_seconds"); n != 4 {
		t.Fatalf("latency histograms for %d ops, want 4 (hello, create, open, unlink)", n)
	}
	if n := testutil.CollectAndCount(m.Registry(), "gpushm_device_memory_total_bytes"); n != 1 {
		t.Fatalf("%d device memory series, want 1", n)
	}

	// Closing the last lease frees the unlinked segment; closing the
	// connection drops the gauge.
	a.Close()
	c.Close()
	want = `
# HELP gpushm_segment_bytes Bytes allocated to segments, by device, owner and whether a name still points at them.
# TYPE gpushm_segment_bytes gauge
gpushm_segment_bytes{device="0",named="true",uid="0",user="root",uuid=""} 4096
`
	if err := testutil.GatherAndCompare(m.Registry(), strings.NewReader(want), "gpushm_segment_bytes"); err != nil {
		t.Fatal(err)
	}
}
