// Package metrics exposes the daemon's state and activity to Prometheus.
//
// Gauges (segments, bytes, leases, device memory, quota use, the node's
// GPUs) are read from the registry, the backend and the GPU report when
// scraped, so they cannot drift from the truth; counters and latency
// histograms are fed by the server through Observe.
//
// Labels are chosen so that a dashboard can say who holds how much of which
// GPU: device (gpushm's ordinal) and uuid name the GPU, uid and user the
// owner, segment and id the segment. docs/metrics.md lists every metric.
package metrics

import (
	"cmp"
	"os/user"
	"runtime"
	"slices"
	"strconv"
	"sync"
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
	TierStats() segment.TierStats
}

// Metrics is the daemon's metric set.
type Metrics struct {
	reg      *prometheus.Registry
	ops      *prometheus.CounterVec
	latency  *prometheus.HistogramVec
	moves    *prometheus.HistogramVec
	conns    prometheus.Gauge
	backend  string
	src      Source
	segments *prometheus.Desc
	bytes    *prometheus.Desc
	leases   *prometheus.Desc
	devTotal *prometheus.Desc
	devFree  *prometheus.Desc

	gpus  func() *wire.GPUReport
	users userNames
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
		moves: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "gpushm_tier_move_duration_seconds",
			Help: "Time to move a segment between its device and host memory, by kind: evict (to host) or restore (back, on an open or a load).",
			// 1 ms to about 130 s: a small segment's move is a millisecond,
			// 16 GiB at PCIe speed a third of a second, more when the
			// restore has to evict first.
			Buckets: prometheus.ExponentialBuckets(1e-3, 2, 18),
		}, []string{"kind"}),
		conns: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "gpushm_connections",
			Help: "Client connections open now.",
		}),
		segments: prometheus.NewDesc("gpushm_segments",
			"Segments holding memory, by device, owner and whether a name still points at them.",
			[]string{"device", "uuid", "uid", "user", "named"}, nil),
		bytes: prometheus.NewDesc("gpushm_segment_bytes",
			"Bytes allocated to segments, by device, owner and whether a name still points at them.",
			[]string{"device", "uuid", "uid", "user", "named"}, nil),
		leases: prometheus.NewDesc("gpushm_leases",
			"Opens held on segments, by device and owner.",
			[]string{"device", "uuid", "uid", "user"}, nil),
		devTotal: prometheus.NewDesc("gpushm_device_memory_total_bytes",
			"Memory of each device the daemon serves.", []string{"device", "name", "uuid"}, nil),
		devFree: prometheus.NewDesc("gpushm_device_memory_free_bytes",
			"Free memory of each device the daemon serves, as the driver reports it.", []string{"device", "name", "uuid"}, nil),
	}
	m.reg.MustRegister(m.ops, m.latency, m.moves, m.conns, (*state)(m),
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

// SetBuild reports the daemon's version as gpushm_build_info, with the Go
// release it was built with and the backend it serves: always 1, a series
// to join others with by instance, as Prometheus' own *_build_info are.
// Call it once, before serving.
func (m *Metrics) SetBuild(version string) {
	m.reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name:        "gpushm_build_info",
		Help:        "Always 1: the daemon's version, the Go release it was built with, and its backend.",
		ConstLabels: prometheus.Labels{"version": version, "goversion": runtime.Version(), "backend": m.backend},
	}, func() float64 { return 1 }))
}

// SetGPUs makes scrapes report the node's GPUs as f reports them (NVML's
// figures, or the driver's); call before serving.
func (m *Metrics) SetGPUs(f func() *wire.GPUReport) { m.gpus = f }

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

// ObserveMove records one move between tiers.
func (m *Metrics) ObserveMove(kind string, _ int64, d time.Duration) {
	m.moves.WithLabelValues(kind).Observe(d.Seconds())
}

// Connected counts a connection opening (+1) or closing (-1).
func (m *Metrics) Connected(delta int) { m.conns.Add(float64(delta)) }

var quotaDesc = prometheus.NewDesc("gpushm_quota_used",
	"Use of each quota in force (bytes or segments, as its kind says); gpushm_quota_limit has the limit.", []string{"kind", "scope"}, nil)
var quotaLimitDesc = prometheus.NewDesc("gpushm_quota_limit",
	"Each quota in force: bytes or a count, per kind and scope.", []string{"kind", "scope"}, nil)

// MaxSegmentSeries bounds the per-segment series a scrape reports, the
// largest segments first, so that a registry of many small segments
// cannot swamp Prometheus; the per-owner series always count them all.
const MaxSegmentSeries = 1000

var (
	segmentDesc = prometheus.NewDesc("gpushm_segment_allocated_bytes",
		"Bytes allocated to one segment (the largest 1000), with its name (empty once unlinked), id, device and owner.",
		[]string{"segment", "id", "device", "uuid", "uid", "user"}, nil)
	gpuSourceDesc = prometheus.NewDesc("gpushm_gpu_source_info",
		"Where the gpushm_gpu_* figures come from: nvml, cuda (the driver's cuMemGetInfo: memory only) or none; always 1.",
		[]string{"source", "driver"}, nil)
	gpuLabels     = []string{"gpu", "device", "name", "uuid"}
	gpuTotalDesc  = prometheus.NewDesc("gpushm_gpu_memory_total_bytes", "Memory of each GPU of the node.", gpuLabels, nil)
	gpuUsedDesc   = prometheus.NewDesc("gpushm_gpu_memory_used_bytes", "Memory in use on each GPU of the node, by every process and the driver.", gpuLabels, nil)
	gpuUtilDesc   = prometheus.NewDesc("gpushm_gpu_utilization_ratio", "Share of NVML's last sample period in which a kernel ran on the GPU (NVML only).", gpuLabels, nil)
	tierBytesDesc = prometheus.NewDesc("gpushm_tier_bytes",
		"Bytes of segments by where they live: tier gpu (on their device; on the host backend, the memory it serves) by device, tier host (evicted to host memory), or tier host_copy (host copies of segments back on their device and opened only read-only since, which make their next eviction a swap).",
		[]string{"tier", "device"}, nil)
	tierBudgetDesc = prometheus.NewDesc("gpushm_tier_budget_bytes",
		"The bound on each tier: a device's budget (tier gpu), or what may be evicted to host memory (tier host); 0 is none.",
		[]string{"tier", "device"}, nil)
	movesDesc = prometheus.NewDesc("gpushm_tier_moves_total",
		"Segments moved between their device and host memory since the serving process started, by kind: evict or restore.",
		[]string{"kind"}, nil)
	movedBytesDesc = prometheus.NewDesc("gpushm_tier_moved_bytes_total",
		"Bytes moved between devices and host memory since the serving process started, by kind: evict or restore.",
		[]string{"kind"}, nil)
	reserveBytesDesc = prometheus.NewDesc("gpushm_host_reserve_bytes",
		"Host memory made ahead of evictions and ready (gpushm daemon --host-reserve).", nil, nil)
	reserveTargetDesc = prometheus.NewDesc("gpushm_host_reserve_target_bytes",
		"The host memory the reserve holds when full; 0 when there is none.", nil, nil)
	reserveTakesDesc = prometheus.NewDesc("gpushm_host_reserve_takes_total",
		"Evictions (and growths of evicted segments) that took their host memory from the reserve, since the serving process started.", nil, nil)
	gpuProcessDesc = prometheus.NewDesc("gpushm_gpu_process_memory_bytes",
		"GPU memory NVML charges to each process (NVML only); command, uid and user are empty where the daemon cannot see the process.",
		[]string{"gpu", "device", "uuid", "pid", "command", "uid", "user"}, nil)
)

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
	ch <- segmentDesc
	ch <- gpuSourceDesc
	ch <- gpuTotalDesc
	ch <- gpuUsedDesc
	ch <- gpuUtilDesc
	ch <- gpuProcessDesc
	ch <- tierBytesDesc
	ch <- tierBudgetDesc
	ch <- movesDesc
	ch <- movedBytesDesc
	ch <- reserveBytesDesc
	ch <- reserveTargetDesc
	ch <- reserveTakesDesc
}

func (s *state) Collect(ch chan<- prometheus.Metric) {
	uuids := map[int]string{}
	if devs, err := s.src.Devices(); err == nil {
		for _, d := range devs {
			labels := []string{strconv.Itoa(d.Index), d.Name, d.UUID}
			ch <- prometheus.MustNewConstMetric(s.devTotal, prometheus.GaugeValue, float64(d.TotalBytes), labels...)
			ch <- prometheus.MustNewConstMetric(s.devFree, prometheus.GaugeValue, float64(d.FreeBytes), labels...)
			uuids[d.Index] = d.UUID
		}
	}
	s.collectSegments(ch, uuids)
	for _, u := range s.src.Quotas() {
		ch <- prometheus.MustNewConstMetric(quotaDesc, prometheus.GaugeValue, float64(u.Used), u.Kind, u.Scope)
		ch <- prometheus.MustNewConstMetric(quotaLimitDesc, prometheus.GaugeValue, float64(u.Limit), u.Kind, u.Scope)
	}
	if s.gpus != nil {
		s.collectGPUs(ch, s.gpus())
	}
	s.collectTiers(ch)
}

func (s *state) collectTiers(ch chan<- prometheus.Metric) {
	t := s.src.TierStats()
	for _, d := range t.Devices {
		dev := strconv.Itoa(d.Device)
		ch <- prometheus.MustNewConstMetric(tierBytesDesc, prometheus.GaugeValue, float64(d.Bytes), "gpu", dev)
		ch <- prometheus.MustNewConstMetric(tierBudgetDesc, prometheus.GaugeValue, float64(d.Budget), "gpu", dev)
	}
	ch <- prometheus.MustNewConstMetric(tierBytesDesc, prometheus.GaugeValue, float64(t.HostBytes), "host", "")
	ch <- prometheus.MustNewConstMetric(tierBytesDesc, prometheus.GaugeValue, float64(t.CleanBytes), "host_copy", "")
	ch <- prometheus.MustNewConstMetric(tierBudgetDesc, prometheus.GaugeValue, float64(t.HostBudget), "host", "")
	ch <- prometheus.MustNewConstMetric(movesDesc, prometheus.CounterValue, float64(t.Evictions), "evict")
	ch <- prometheus.MustNewConstMetric(movesDesc, prometheus.CounterValue, float64(t.Restores), "restore")
	ch <- prometheus.MustNewConstMetric(movedBytesDesc, prometheus.CounterValue, float64(t.EvictedBytes), "evict")
	ch <- prometheus.MustNewConstMetric(movedBytesDesc, prometheus.CounterValue, float64(t.RestoredBytes), "restore")
	ch <- prometheus.MustNewConstMetric(reserveBytesDesc, prometheus.GaugeValue, float64(t.Reserve.Bytes))
	ch <- prometheus.MustNewConstMetric(reserveTargetDesc, prometheus.GaugeValue, float64(t.Reserve.Target))
	ch <- prometheus.MustNewConstMetric(reserveTakesDesc, prometheus.CounterValue, float64(t.Reserve.Takes))
}

func (s *state) collectSegments(ch chan<- prometheus.Metric, uuids map[int]string) {
	type key struct {
		dev   int
		uid   uint32
		named bool
	}
	type sum struct {
		n, bytes int64
		leases   int
	}
	infos := s.src.Segments()
	sums := map[key]*sum{}
	for _, inf := range infos {
		k := key{inf.Device, inf.UID, inf.Linked}
		if sums[k] == nil {
			sums[k] = &sum{}
		}
		sums[k].n++
		sums[k].bytes += inf.AllocSize
		sums[k].leases += inf.Opens
	}
	type owner struct {
		dev int
		uid uint32
	}
	leases := map[owner]int{}
	for k, v := range sums {
		dev, uid := strconv.Itoa(k.dev), strconv.FormatUint(uint64(k.uid), 10)
		labels := []string{dev, uuids[k.dev], uid, s.users.name(k.uid), strconv.FormatBool(k.named)}
		ch <- prometheus.MustNewConstMetric(s.segments, prometheus.GaugeValue, float64(v.n), labels...)
		ch <- prometheus.MustNewConstMetric(s.bytes, prometheus.GaugeValue, float64(v.bytes), labels...)
		leases[owner{k.dev, k.uid}] += v.leases
	}
	for k, n := range leases {
		ch <- prometheus.MustNewConstMetric(s.leases, prometheus.GaugeValue, float64(n),
			strconv.Itoa(k.dev), uuids[k.dev], strconv.FormatUint(uint64(k.uid), 10), s.users.name(k.uid))
	}
	if len(infos) > MaxSegmentSeries {
		slices.SortFunc(infos, func(a, b segment.Info) int {
			return cmp.Or(cmp.Compare(b.AllocSize, a.AllocSize), cmp.Compare(a.ID, b.ID))
		})
		infos = infos[:MaxSegmentSeries]
	}
	for _, inf := range infos {
		name := inf.Name
		if !inf.Linked {
			name = ""
		}
		ch <- prometheus.MustNewConstMetric(segmentDesc, prometheus.GaugeValue, float64(inf.AllocSize),
			name, strconv.FormatUint(inf.ID, 10), strconv.Itoa(inf.Device), uuids[inf.Device],
			strconv.FormatUint(uint64(inf.UID), 10), s.users.name(inf.UID))
	}
}

func (s *state) collectGPUs(ch chan<- prometheus.Metric, r *wire.GPUReport) {
	if r == nil {
		return
	}
	ch <- prometheus.MustNewConstMetric(gpuSourceDesc, prometheus.GaugeValue, 1, r.Source, r.Driver)
	for _, g := range r.GPUs {
		gpu, dev := strconv.Itoa(g.Index), ""
		if g.Device != nil {
			dev = strconv.Itoa(*g.Device)
		}
		labels := []string{gpu, dev, g.Name, g.UUID}
		ch <- prometheus.MustNewConstMetric(gpuTotalDesc, prometheus.GaugeValue, float64(g.TotalBytes), labels...)
		ch <- prometheus.MustNewConstMetric(gpuUsedDesc, prometheus.GaugeValue, float64(g.UsedBytes), labels...)
		if g.Utilization != nil {
			ch <- prometheus.MustNewConstMetric(gpuUtilDesc, prometheus.GaugeValue, float64(*g.Utilization)/100, labels...)
		}
		for _, p := range g.Processes {
			uid, name := "", ""
			if p.UID != nil {
				uid, name = strconv.FormatUint(uint64(*p.UID), 10), s.users.name(*p.UID)
			}
			ch <- prometheus.MustNewConstMetric(gpuProcessDesc, prometheus.GaugeValue, float64(p.UsedBytes),
				gpu, dev, g.UUID, strconv.FormatUint(uint64(p.PID), 10), p.Command, uid, name)
		}
	}
}

// userNames caches uid -> user name lookups: a lookup may go to a
// directory service, and every scrape asks for every owner.
type userNames struct {
	mu    sync.Mutex
	names map[uint32]userName
}

type userName struct {
	name string
	at   time.Time
}

// userNameTTL is how long a name is trusted before it is looked up again.
const userNameTTL = 5 * time.Minute

// name is uid's user name in the daemon's user database, or the uid in
// decimal when it has none (a container's /etc/passwd rarely knows the
// host's users).
func (u *userNames) name(uid uint32) string {
	u.mu.Lock()
	defer u.mu.Unlock()
	if e, ok := u.names[uid]; ok && time.Since(e.at) < userNameTTL {
		return e.name
	}
	id := strconv.FormatUint(uint64(uid), 10)
	name := id
	if usr, err := user.LookupId(id); err == nil {
		name = usr.Username
	}
	if u.names == nil {
		u.names = map[uint32]userName{}
	}
	u.names[uid] = userName{name, time.Now()}
	return name
}
