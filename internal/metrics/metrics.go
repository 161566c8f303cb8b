// Package metrics exposes the daemon's state and activity to Prometheus.
//
// Gauges (segments, bytes, leases, device memory, quota use) are read from
// the registry and the backend when scraped, so they cannot drift from the
// truth; counters and latency histograms are fed by the server through
// Observe.
package metrics

import (
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/gpushm/gpushm/internal/segment"
	"github.com/gpushm/gpushm/internal/wire"
)

// Source is what the collector reads at scrape time.
type Source interface {
	Segments() []segment.Info
	Quotas() []segment.QuotaUse
	Devices() ([]wire.Device, error)
}

// Metrics is the daemon's metric set.
type Metrics struct {
	reg      *prometheus.Registry
	ops      *prometheus.CounterVec
	latency  *prometheus.HistogramVec
	conns    prometheus.Gauge
	backend  string
	src      Source
	segments *prometheus.Desc
	bytes    *prometheus.Desc
	leases   *prometheus.Desc
	devTotal *prometheus.Desc
	devFree  *prometheus.Desc
}

// New makes the metric set for a daemon serving backend from src.
func New(backend string, src Source) *Metrics {
	m := &Metrics{
		reg:     prometheus.NewRegistry(),
		backend: backend,
		src:     src,
		ops: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "gpushm_operations_total",
			Help: "Requests answered, by operation and result code (OK or an errno name).",
		}, []string{"op", "code"}),
		latency: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "gpushm_operation_duration_seconds",
			Help: "Time from a request's arrival to its reply being sent, by operation.",
			// 5 us to about 1.3 s: opens take tens of microseconds, creates of
			// large segments milliseconds.
			Buckets: prometheus.ExponentialBuckets(5e-6, 2, 19),
		}, []string{"op"}),
		conns: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "gpushm_connections",
			Help: "Client connections open now.",
		}),
		segments: prometheus.NewDesc("gpushm_segments",
			"Segments holding memory, by device, owner uid and whether a name still points at them.",
			[]string{"device", "uid", "named"}, nil),
		bytes: prometheus.NewDesc("gpushm_segment_bytes",
			"Bytes allocated to segments, by device, owner uid and whether a name still points at them.",
			[]string{"device", "uid", "named"}, nil),
		leases: prometheus.NewDesc("gpushm_leases",
			"Opens held on segments, by device and owner uid.",
			[]string{"device", "uid"}, nil),
		devTotal: prometheus.NewDesc("gpushm_device_memory_total_bytes",
			"Memory of each device the daemon serves.", []string{"device", "name", "uuid"}, nil),
		devFree: prometheus.NewDesc("gpushm_device_memory_free_bytes",
			"Free memory of each device the daemon serves, as the driver reports it.", []string{"device", "name", "uuid"}, nil),
	}
	m.reg.MustRegister(m.ops, m.latency, m.conns, (*state)(m),
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

// Registry is what to serve at /metrics.
func (m *Metrics) Registry() *prometheus.Registry { return m.reg }

// Observe records one answered request; code is "" for success.
func (m *Metrics) Observe(op, code string, d time.Duration) {
	if code == "" {
		code = "OK"
	}
	m.ops.WithLabelValues(op, code).Inc()
	m.latency.WithLabelValues(op).Observe(d.Seconds())
}

// Connected counts a connection opening (+1) or closing (-1).
func (m *Metrics) Connected(delta int) { m.conns.Add(float64(delta)) }

var quotaDesc = prometheus.NewDesc("gpushm_quota_used",
	"Use of each quota in force (bytes or segments, as its kind says); gpushm_quota_limit has the limit.", []string{"kind", "scope"}, nil)
var quotaLimitDesc = prometheus.NewDesc("gpushm_quota_limit",
	"Each quota in force: bytes or a count, per kind and scope.", []string{"kind", "scope"}, nil)

// state is the scrape-time half of Metrics.
type state Metrics

func (s *state) Describe(ch chan<- *prometheus.Desc) {
	ch <- s.segments
	ch <- s.bytes
	ch <- s.leases
	ch <- s.devTotal
	ch <- s.devFree
	ch <- quotaDesc
	ch <- quotaLimitDesc
}

func (s *state) Collect(ch chan<- prometheus.Metric) {
	type key struct {
		dev   int
		uid   uint32
		named bool
	}
	type sum struct {
		n, bytes int64
		leases   int
	}
	sums := map[key]*sum{}
	for _, inf := range s.src.Segments() {
		k := key{inf.Device, inf.UID, inf.Linked}
		if sums[k] == nil {
			sums[k] = &sum{}
		}
		sums[k].n++
		sums[k].bytes += inf.AllocSize
		sums[k].leases += inf.Opens
	}
	leases := map[[2]string]int{}
	for k, v := range sums {
		dev, uid := strconv.Itoa(k.dev), strconv.FormatUint(uint64(k.uid), 10)
		named := strconv.FormatBool(k.named)
		ch <- prometheus.MustNewConstMetric(s.segments, prometheus.GaugeValue, float64(v.n), dev, uid, named)
		ch <- prometheus.MustNewConstMetric(s.bytes, prometheus.GaugeValue, float64(v.bytes), dev, uid, named)
		leases[[2]string{dev, uid}] += v.leases
	}
	for k, n := range leases {
		ch <- prometheus.MustNewConstMetric(s.leases, prometheus.GaugeValue, float64(n), k[0], k[1])
	}
	if devs, err := s.src.Devices(); err == nil {
		for _, d := range devs {
			labels := []string{strconv.Itoa(d.Index), d.Name, d.UUID}
			ch <- prometheus.MustNewConstMetric(s.devTotal, prometheus.GaugeValue, float64(d.TotalBytes), labels...)
			ch <- prometheus.MustNewConstMetric(s.devFree, prometheus.GaugeValue, float64(d.FreeBytes), labels...)
		}
	}
	for _, u := range s.src.Quotas() {
		ch <- prometheus.MustNewConstMetric(quotaDesc, prometheus.GaugeValue, float64(u.Used), u.Kind, u.Scope)
		ch <- prometheus.MustNewConstMetric(quotaLimitDesc, prometheus.GaugeValue, float64(u.Limit), u.Kind, u.Scope)
	}
}
