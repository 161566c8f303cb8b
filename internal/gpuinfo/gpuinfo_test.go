package gpuinfo

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/gpushm/gpushm/internal/nvml"
	"github.com/gpushm/gpushm/internal/wire"
)

type fakeNVML struct {
	gpus []nvml.GPU
	err  error
}

func (f fakeNVML) GPUs() ([]nvml.GPU, error) { return f.gpus, f.err }
func (f fakeNVML) Driver() string            { return "580.65.06" }

type fakeBackend struct {
	name string
	devs []wire.Device
	err  error
}

func (f fakeBackend) Name() string                    { return f.name }
func (f fakeBackend) Devices() ([]wire.Device, error) { return f.devs, f.err }

const (
	uuidA = "GPU-5e6f0000-aaaa-bbbb-cccc-000000000001"
	uuidB = "GPU-5e6f0000-aaaa-bbbb-cccc-000000000002"
)

// The backend serves GPU B only, as ordinal 0: CUDA's order is not NVML's.
var cudaBackend = fakeBackend{name: "cuda", devs: []wire.Device{
	{Index: 0, Name: "NVIDIA H200", UUID: strings.ToUpper(uuidB), TotalBytes: 100, FreeBytes: 60, Granularity: 2 << 20},
}}

func TestNVMLReport(t *testing.T) {
	self := uint32(os.Getpid())
	var many []nvml.Process
	for i := range MaxProcesses + 3 {
		many = append(many, nvml.Process{PID: 4000000 + uint32(i), UsedBytes: uint64(i)})
	}
	src := fakeNVML{gpus: []nvml.GPU{
		{Index: 0, Name: "NVIDIA H200", UUID: uuidA, TotalBytes: 100, UsedBytes: 10, Utilization: 55,
			Processes: []nvml.Process{{PID: 4194303, UsedBytes: 1}, {PID: self, UsedBytes: 7}}},
		{Index: 1, Name: "NVIDIA H200", UUID: uuidB, TotalBytes: 100, UsedBytes: 40, Utilization: -1,
			ProcessErr: errors.New("nvmlDeviceGetComputeRunningProcesses: Not Supported")},
		{Index: 2, Name: "NVIDIA H200", UUID: "GPU-other", TotalBytes: 100, Utilization: 0, Processes: many},
	}}
	m := New(src, cudaBackend, "")
	m.hostPIDs = true
	r := m.Report()
	if r.Source != SourceNVML || r.Driver != "580.65.06" || len(r.GPUs) != 3 {
		t.Fatalf("report = %+v", r)
	}
	a, b, c := r.GPUs[0], r.GPUs[1], r.GPUs[2]
	if a.Device != nil || b.Device == nil || *b.Device != 0 || c.Device != nil {
		t.Errorf("devices: %v %v %v, want only GPU 1 (NVML) served, as ordinal 0", a.Device, b.Device, c.Device)
	}
	if a.Utilization == nil || *a.Utilization != 55 || b.Utilization != nil || c.Utilization == nil || *c.Utilization != 0 {
		t.Errorf("utilisation %v %v %v, want 55, unknown, 0", a.Utilization, b.Utilization, c.Utilization)
	}
	// The largest first; this process named from /proc, a missing one not.
	if len(a.Processes) != 2 || a.Processes[0].PID != self || a.Processes[1].PID != 4194303 {
		t.Fatalf("GPU 0 processes = %+v", a.Processes)
	}
	me, gone := a.Processes[0], a.Processes[1]
	exe, _ := os.Executable()
	if want := filepath.Base(exe); me.Command == "" || !strings.HasPrefix(want, me.Command) || me.UID == nil || *me.UID != uint32(os.Getuid()) {
		t.Errorf("this process = %+v, want command %q (cut to 15 bytes) and uid %d", me, want, os.Getuid())
	}
	if gone.Command != "" || gone.UID != nil || gone.UsedBytes != 1 {
		t.Errorf("a process /proc lacks = %+v, want no name and no uid", gone)
	}
	if len(c.Processes) != MaxProcesses || c.MoreProcesses != 3 || c.Processes[0].UsedBytes != MaxProcesses+2 {
		t.Errorf("GPU 2: %d processes, %d more, the first using %d; want %d, 3 and the largest",
			len(c.Processes), c.MoreProcesses, c.Processes[0].UsedBytes, MaxProcesses)
	}
	if !strings.Contains(r.Note, "GPU 1: nvmlDeviceGetComputeRunningProcesses: Not Supported") {
		t.Errorf("note %q does not say that GPU 1's processes are unknown", r.Note)
	}

	// In a container's PID namespace, NVML's PIDs are not ours to name.
	m.hostPIDs = false
	r = m.Report()
	if p := r.GPUs[0].Processes[0]; p.Command != "" || p.UID != nil {
		t.Errorf("outside the host PID namespace, process = %+v, want PID and memory only", p)
	}
	if !strings.Contains(r.Note, "host's PID namespace") {
		t.Errorf("note %q does not say why processes are unnamed", r.Note)
	}
}

func TestNVMLPartialFailure(t *testing.T) {
	src := fakeNVML{
		gpus: []nvml.GPU{{Index: 0, Name: "NVIDIA H200", UUID: uuidA, TotalBytes: 100, Utilization: -1}},
		err:  errors.New("GPU 1: nvmlDeviceGetUUID: GPU is lost"),
	}
	r := New(src, cudaBackend, "").Report()
	if r.Source != SourceNVML || len(r.GPUs) != 1 || !strings.Contains(r.Note, "GPU is lost") {
		t.Fatalf("report = %+v, want the readable GPU and a note on the lost one", r)
	}
}

func TestFallbacks(t *testing.T) {
	r := New(nil, cudaBackend, "NVML: libnvidia-ml.so.1 not found").Report()
	want := wire.GPU{Index: 0, Name: "NVIDIA H200", UUID: strings.ToUpper(uuidB), TotalBytes: 100, UsedBytes: 40}
	if r.Source != SourceCUDA || r.Note != "NVML: libnvidia-ml.so.1 not found" || len(r.GPUs) != 1 {
		t.Fatalf("report = %+v", r)
	}
	g := r.GPUs[0]
	if g.Device == nil || *g.Device != 0 || g.Utilization != nil || g.Processes != nil {
		t.Errorf("GPU from the driver = %+v, want served as 0, no utilisation or processes", g)
	}
	g.Device = nil
	if g.Index != want.Index || g.Name != want.Name || g.UUID != want.UUID || g.TotalBytes != want.TotalBytes || g.UsedBytes != want.UsedBytes {
		t.Errorf("GPU from the driver = %+v, want %+v", g, want)
	}

	r = New(nil, fakeBackend{name: "cuda", err: errors.New("cuMemGetInfo: CUDA_ERROR_UNKNOWN")}, "").Report()
	if r.Source != SourceCUDA || len(r.GPUs) != 0 || !strings.Contains(r.Note, "CUDA_ERROR_UNKNOWN") {
		t.Errorf("report with the driver failing = %+v", r)
	}

	host := fakeBackend{name: "host", devs: []wire.Device{{Index: 0, Name: "host memory", TotalBytes: 100}}}
	r = New(nil, host, "NVML: off").Report()
	if r.Source != SourceNone || len(r.GPUs) != 0 || r.Note != "host memory backend; NVML: off" {
		t.Errorf("host report = %+v", r)
	}
}

// fakeProc writes a /proc with the given processes: pid -> command, uid.
func fakeProc(t *testing.T, procs map[int][2]string) string {
	t.Helper()
	root := t.TempDir()
	for pid, p := range procs {
		dir := filepath.Join(root, strconv.Itoa(pid))
		if err := os.Mkdir(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		os.WriteFile(filepath.Join(dir, "comm"), []byte(p[0]+"\n"), 0o644)
		status := "Name:\t" + p[0] + "\nUid:\t" + p[1] + "\t" + p[1] + "\t" + p[1] + "\t" + p[1] + "\n"
		os.WriteFile(filepath.Join(dir, "status"), []byte(status), 0o644)
	}
	return root
}

func TestEachUserSeesItsOwnProcesses(t *testing.T) {
	src := fakeNVML{gpus: []nvml.GPU{{Index: 0, Name: "NVIDIA H200", UUID: uuidA, TotalBytes: 100, Utilization: 3,
		Processes: []nvml.Process{{PID: 101, UsedBytes: 30}, {PID: 102, UsedBytes: 20}, {PID: 103, UsedBytes: 10}, {PID: 999, UsedBytes: 5}}}}}
	m := New(src, cudaBackend, "")
	m.hostPIDs = true
	m.proc = fakeProc(t, map[int][2]string{101: {"trainer", "1000"}, 102: {"python3", "2000"}, 103: {"python3", "1000"}})
	pids := func(r *wire.GPUReport) (out []uint32, more int) {
		for _, p := range r.GPUs[0].Processes {
			out = append(out, p.PID)
		}
		return out, r.GPUs[0].MoreProcesses
	}
	tests := []struct {
		uid  uint32
		want []uint32
		more int
	}{
		{0, []uint32{101, 102, 103, 999}, 0}, // root sees all, 999's owner unknown
		{1000, []uint32{101, 103}, 2},
		{2000, []uint32{102}, 3},
		{3000, nil, 4},
	}
	for _, tc := range tests {
		got, more := pids(m.ReportFor(tc.uid))
		if !slices.Equal(got, tc.want) || more != tc.more {
			t.Errorf("ReportFor(%d): processes %v, %d more; want %v, %d more", tc.uid, got, more, tc.want, tc.more)
		}
	}
	if r := m.Report(); len(r.GPUs[0].Processes) != 4 || r.GPUs[0].Processes[0].Command != "trainer" || *r.GPUs[0].Processes[0].UID != 1000 {
		t.Errorf("Report (for metrics) = %+v, want every process, named", r.GPUs[0].Processes)
	}
}
