// Package gpuinfo reports the node's GPUs for info replies and metrics:
// memory, utilisation and the processes using each GPU from NVML when it
// loads, or the memory figures of the GPUs the daemon serves from the CUDA
// driver (cuMemGetInfo) otherwise; the report says which.
package gpuinfo

import (
	"cmp"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"syscall"

	"github.com/gpushm/gpushm/internal/nvml"
	"github.com/gpushm/gpushm/internal/wire"
)

// Sources a report can name.
const (
	SourceNVML = "nvml"
	SourceCUDA = "cuda"
	SourceNone = "none"
)

// MaxProcesses bounds the processes reported per GPU, the largest first,
// so that an info reply fits in one packet on a node with many GPUs.
const MaxProcesses = 32

// Source is where GPU figures come from: *nvml.NVML, or a fake in tests.
type Source interface {
	GPUs() ([]nvml.GPU, error)
	Driver() string
}

// Backend is what the monitor needs of the daemon's backend.
type Backend interface {
	Name() string
	Devices() ([]wire.Device, error)
}

// Monitor makes GPU reports. It is safe for concurrent use.
type Monitor struct {
	src  Source // nil without NVML
	b    Backend
	note string
	// hostPIDs says that PIDs from NVML (the host's) name processes in
	// this process's /proc.
	hostPIDs bool
	proc     string // procfs root
}

// New makes a monitor reading GPUs from src, or from b's devices when src
// is nil; why says why src is nil, for the report's note.
func New(src Source, b Backend, why string) *Monitor {
	return &Monitor{src: src, b: b, note: why, hostPIDs: inHostPIDNamespace(), proc: "/proc"}
}

// initPIDNamespace is the inode number of the initial PID namespace
// (PROC_PID_INIT_INO), fixed by the kernel since Linux 3.8.
const initPIDNamespace = 0xEFFFFFFC

func inHostPIDNamespace() bool {
	var st syscall.Stat_t
	return syscall.Stat("/proc/self/ns/pid", &st) == nil && st.Ino == initPIDNamespace
}

// Report reads the GPUs now, with every process: for metrics, and root.
func (m *Monitor) Report() *wire.GPUReport { return m.ReportFor(0) }

// ReportFor reads the GPUs now as a client of uid may see them: the
// processes of other users (and those whose owner is unknown) are left out
// and counted in MoreProcesses, so that one tenant does not learn what
// another runs. Root sees every process.
func (m *Monitor) ReportFor(uid uint32) *wire.GPUReport {
	if m.src == nil {
		return m.fromBackend()
	}
	r := &wire.GPUReport{Source: SourceNVML, Driver: m.src.Driver()}
	var notes []string
	gpus, err := m.src.GPUs()
	if err != nil {
		notes = append(notes, err.Error())
	}
	ordinals := map[string]int{}
	if devs, err := m.b.Devices(); err == nil {
		for _, d := range devs {
			if d.UUID != "" {
				ordinals[normUUID(d.UUID)] = d.Index
			}
		}
	}
	named := false
	for _, g := range gpus {
		w := wire.GPU{Index: g.Index, Name: g.Name, UUID: g.UUID, TotalBytes: g.TotalBytes, UsedBytes: g.UsedBytes}
		if i, ok := ordinals[normUUID(g.UUID)]; ok {
			w.Device = &i
		}
		if g.Utilization >= 0 {
			u := g.Utilization
			w.Utilization = &u
		}
		if g.ProcessErr != nil {
			notes = append(notes, fmt.Sprintf("GPU %d: %v", g.Index, g.ProcessErr))
		}
		w.Processes, w.MoreProcesses = m.processes(g.Processes, uid)
		named = named || len(w.Processes) > 0
		r.GPUs = append(r.GPUs, w)
	}
	if named && !m.hostPIDs {
		notes = append(notes, "process names and owners need the host's PID namespace (NVML reports host PIDs)")
	}
	r.Note = strings.Join(notes, "; ")
	return r
}

// fromBackend reports the devices a cuda backend serves, from the driver.
func (m *Monitor) fromBackend() *wire.GPUReport {
	if m.b.Name() != "cuda" {
		return &wire.GPUReport{Source: SourceNone, Note: join("host memory backend", m.note)}
	}
	r := &wire.GPUReport{Source: SourceCUDA, Note: m.note}
	devs, err := m.b.Devices()
	if err != nil {
		r.Note = join(r.Note, err.Error())
		return r
	}
	for _, d := range devs {
		i := d.Index
		r.GPUs = append(r.GPUs, wire.GPU{Index: i, Device: &i, Name: d.Name, UUID: d.UUID,
			TotalBytes: d.TotalBytes, UsedBytes: d.TotalBytes - min(d.FreeBytes, d.TotalBytes)})
	}
	return r
}

func join(a, b string) string {
	if a == "" || b == "" {
		return a + b
	}
	return a + "; " + b
}

// processes turns NVML's processes into the report's, the largest first,
// naming them from /proc where the PIDs are ours; it keeps at most
// MaxProcesses that a client of uid may see, and counts the rest.
func (m *Monitor) processes(ps []nvml.Process, uid uint32) ([]wire.GPUProcess, int) {
	ps = slices.SortedStableFunc(slices.Values(ps), func(a, b nvml.Process) int {
		return cmp.Or(cmp.Compare(b.UsedBytes, a.UsedBytes), cmp.Compare(a.PID, b.PID))
	})
	var out []wire.GPUProcess
	more := 0
	for _, p := range ps {
		w := wire.GPUProcess{PID: p.PID, UsedBytes: p.UsedBytes}
		if m.hostPIDs {
			w.Command, w.UID = m.describe(p.PID)
		}
		if uid != 0 && (w.UID == nil || *w.UID != uid) || len(out) == MaxProcesses {
			more++
			continue
		}
		out = append(out, w)
	}
	return out, more
}

// describe reads a process's command name and real uid from /proc; either
// is empty when the process is gone or hidden.
func (m *Monitor) describe(pid uint32) (string, *uint32) {
	dir := m.proc + "/" + strconv.FormatUint(uint64(pid), 10)
	var command string
	if b, err := os.ReadFile(dir + "/comm"); err == nil {
		command = strings.TrimSuffix(string(b), "\n")
	}
	status, err := os.ReadFile(dir + "/status")
	if err != nil {
		return command, nil
	}
	for line := range strings.Lines(string(status)) {
		if rest, ok := strings.CutPrefix(line, "Uid:"); ok {
			f := strings.Fields(rest)
			if len(f) == 0 {
				break
			}
			if uid, err := strconv.ParseUint(f[0], 10, 32); err == nil {
				u := uint32(uid)
				return command, &u
			}
		}
	}
	return command, nil
}

// normUUID compares GPU UUIDs as the CUDA driver and NVML print them.
func normUUID(s string) string {
	return strings.TrimPrefix(strings.ToLower(s), "gpu-")
}
