package metrics_test

import (
	"os/user"
	"strconv"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/gpushm/gpushm/internal/metrics"
	"github.com/gpushm/gpushm/internal/segment"
	"github.com/gpushm/gpushm/internal/wire"
)

// fakeSource is a registry and backend with fixed contents.
type fakeSource struct {
	segs []segment.Info
	devs []wire.Device
}

func (f fakeSource) Segments() []segment.Info        { return f.segs }
func (f fakeSource) Quotas() []segment.QuotaUse      { return nil }
func (f fakeSource) Devices() ([]wire.Device, error) { return f.devs, nil }
func (f fakeSource) TierStats() segment.TierStats {
	return segment.TierStats{Devices: []segment.DeviceTier{{Device: 0, Budget: 800, Bytes: 400, Peak: 600}},
		HostBudget: 2000, HostBytes: 300, Evictions: 2, Restores: 1, EvictedBytes: 600, RestoredBytes: 300}
}

const uuid1 = "GPU-5e6f0000-aaaa-bbbb-cccc-000000000002"

func ptr[T any](v T) *T { return &v }

// report is a node with two GPUs, of which gpushm serves NVML's GPU 1 as
// its device 0.
var report = &wire.GPUReport{Source: "nvml", Driver: "580.65.06", GPUs: []wire.GPU{
	{Index: 0, Name: "NVIDIA H200", UUID: "GPU-other", TotalBytes: 1000, UsedBytes: 10},
	{Index: 1, Device: ptr(0), Name: "NVIDIA H200", UUID: uuid1, TotalBytes: 1000, UsedBytes: 600, Utilization: ptr(25),
		Processes: []wire.GPUProcess{
			{PID: 7, UsedBytes: 500, Command: "python3", UID: ptr(uint32(0))},
			{PID: 8, UsedBytes: 90}, // in another PID namespace: no name
		}},
}}

func TestGPUMetrics(t *testing.T) {
	src := fakeSource{
		devs: []wire.Device{{Index: 0, Name: "NVIDIA H200", UUID: uuid1, TotalBytes: 1000, FreeBytes: 400}},
		segs: []segment.Info{{ID: 3, Name: "weights", AllocSize: 400, Device: 0, UID: 0, Linked: true}},
	}
	m := metrics.New("cuda", src)
	m.SetGPUs(func() *wire.GPUReport { return report })
	want := `
# HELP gpushm_gpu_source_info Where the gpushm_gpu_* figures come from: nvml, cuda (the driver's cuMemGetInfo: memory only) or none; always 1.
# TYPE gpushm_gpu_source_info gauge
gpushm_gpu_source_info{driver="580.65.06",source="nvml"} 1
# HELP gpushm_gpu_memory_total_bytes Memory of each GPU of the node.
# TYPE gpushm_gpu_memory_total_bytes gauge
gpushm_gpu_memory_total_bytes{device="",gpu="0",name="NVIDIA H200",uuid="GPU-other"} 1000
gpushm_gpu_memory_total_bytes{device="0",gpu="1",name="NVIDIA H200",uuid="` + uuid1 + `"} 1000
# HELP gpushm_gpu_memory_used_bytes Memory in use on each GPU of the node, by every process and the driver.
# TYPE gpushm_gpu_memory_used_bytes gauge
gpushm_gpu_memory_used_bytes{device="",gpu="0",name="NVIDIA H200",uuid="GPU-other"} 10
gpushm_gpu_memory_used_bytes{device="0",gpu="1",name="NVIDIA H200",uuid="` + uuid1 + `"} 600
# HELP gpushm_gpu_utilization_ratio Share of NVML's last sample period in which a kernel ran on the GPU (NVML only).
# TYPE gpushm_gpu_utilization_ratio gauge
gpushm_gpu_utilization_ratio{device="0",gpu="1",name="NVIDIA H200",uuid="` + uuid1 + `"} 0.25
# HELP gpushm_gpu_process_memory_bytes GPU memory NVML charges to each process (NVML only); command, uid and user are empty where the daemon cannot see the process.
# TYPE gpushm_gpu_process_memory_bytes gauge
gpushm_gpu_process_memory_bytes{command="python3",device="0",gpu="1",pid="7",uid="0",user="root",uuid="` + uuid1 + `"} 500
gpushm_gpu_process_memory_bytes{command="",device="0",gpu="1",pid="8",uid="",user="",uuid="` + uuid1 + `"} 90
# HELP gpushm_segment_allocated_bytes Bytes allocated to one segment (the largest 1000), with its name (empty once unlinked), id, device and owner.
# TYPE gpushm_segment_allocated_bytes gauge
gpushm_segment_allocated_bytes{device="0",id="3",segment="weights",uid="0",user="root",uuid="` + uuid1 + `"} 400
`
	if err := testutil.GatherAndCompare(m.Registry(), strings.NewReader(want),
		"gpushm_gpu_source_info", "gpushm_gpu_memory_total_bytes", "gpushm_gpu_memory_used_bytes",
		"gpushm_gpu_utilization_ratio", "gpushm_gpu_process_memory_bytes", "gpushm_segment_allocated_bytes"); err != nil {
		t.Fatal(err)
	}
}

func TestSegmentSeriesAreBounded(t *testing.T) {
	var src fakeSource
	n := metrics.MaxSegmentSeries + 10
	for i := range n {
		// Unlinked segments share the empty name; ids keep them apart.
		src.segs = append(src.segs, segment.Info{ID: uint64(i + 1), AllocSize: int64(i+1) * 4096, UID: 1000})
	}
	m := metrics.New("host", src)
	if got := testutil.CollectAndCount(m.Registry(), "gpushm_segment_allocated_bytes"); got != metrics.MaxSegmentSeries {
		t.Fatalf("%d per-segment series for %d segments, want %d", got, n, metrics.MaxSegmentSeries)
	}
	// The largest are kept.
	mfs, err := m.Registry().Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != "gpushm_segment_allocated_bytes" {
			continue
		}
		for _, s := range mf.GetMetric() {
			if v := s.GetGauge().GetValue(); v < 11*4096 {
				t.Fatalf("a segment of %v bytes kept among the largest %d", v, metrics.MaxSegmentSeries)
			}
		}
	}
	// The owner's totals still count every segment.
	want := `
# HELP gpushm_segments Segments holding memory, by device, owner and whether a name still points at them.
# TYPE gpushm_segments gauge
gpushm_segments{device="0",named="false",uid="1000",user="` + userOf(t, 1000) + `",uuid=""} 1010
`
	if err := testutil.GatherAndCompare(m.Registry(), strings.NewReader(want), "gpushm_segments"); err != nil {
		t.Fatal(err)
	}
}

// userOf is the user label the daemon gives uid: its name, or the number.
func userOf(t *testing.T, uid int) string {
	t.Helper()
	if u, err := user.LookupId(strconv.Itoa(uid)); err == nil {
		return u.Username
	}
	return strconv.Itoa(uid)
}
