package report

import (
	"fmt"
	"io"
	"runtime"
	"runtime/debug"
	"strconv"
	"text/tabwriter"
	"time"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/bytesize"
	"github.com/gpushm/gpushm/internal/owner"
	"github.com/gpushm/gpushm/internal/wire"
)

// List writes segs as ls's table: sizes in bytes with sizes, and with
// wide each segment's GPU by name and UUID, from devices.
func List(out io.Writer, segs []gpushm.SegmentInfo, backend string, devices []gpushm.Device, sizes, wide bool) error {
	devName := map[int]string{}
	for _, d := range devices {
		devName[d.Index] = d.Name + "\t" + orDash(d.UUID)
	}
	w := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	header := "NAME\tSIZE\tDEVICE\tOWNER\tMODE\tOPENS\tTIER\tOPENED\tAGE\tLIFETIME"
	if wide {
		header += "\tGPU\tUUID"
	}
	fmt.Fprintln(w, header)
	for _, s := range segs {
		size := bytesize.Format(s.Size)
		if sizes {
			size = strconv.FormatInt(s.Size, 10)
		}
		fmt.Fprintf(w, "%s\t%s\t%d\t%s\t%04o\t%d\t%s\t%s\t%s\t%s", s.Name, size, s.Device,
			owner.Format(s.UID, s.GID), s.Mode, s.Opens, Tier(backend, &s), opened(&s),
			age(time.Since(time.Unix(0, s.Created))), Lifetime(&s))
		if wide {
			fmt.Fprintf(w, "\t%s", devName[s.Device])
		}
		fmt.Fprintln(w)
	}
	return w.Flush()
}

// Stat writes s in full, a field a line, as stat prints it.
func Stat(w io.Writer, s *gpushm.SegmentInfo, backend string) {
	fmt.Fprintf(w, "name:        %s\n", s.Name)
	fmt.Fprintf(w, "id:          %d\n", s.ID)
	fmt.Fprintf(w, "size:        %d (%s)\n", s.Size, bytesize.Format(s.Size))
	fmt.Fprintf(w, "allocated:   %d (%s)\n", s.AllocSize, bytesize.Format(s.AllocSize))
	fmt.Fprintf(w, "device:      %d\n", s.Device)
	if s.UUID != "" {
		fmt.Fprintf(w, "gpu:         %s\n", s.UUID)
	}
	fmt.Fprintf(w, "handle:      %s\n", s.HandleType)
	if s.HandleType == wire.HandleCUDA {
		// Whether NIXL, UCX or Mooncake can register it for RDMA.
		fmt.Fprintf(w, "rdma:        %s\n", map[bool]string{true: "yes (GPUDirect RDMA can register it)", false: "no (the device does not allow it with VMM, or the segment is evicted)"}[s.RDMA])
	}
	fmt.Fprintf(w, "owner:       %s (%d:%d)\n", owner.Format(s.UID, s.GID), s.UID, s.GID)
	fmt.Fprintf(w, "mode:        %04o\n", s.Mode)
	fmt.Fprintf(w, "opens:       %d\n", s.Opens)
	fmt.Fprintf(w, "version:     %d\n", max(s.Version, 1))
	for _, v := range s.Versions {
		fmt.Fprintf(w, "held:        version %d (segment %d): %d opens%s\n", v.Version, v.ID, v.Opens, pids(v.PIDs))
	}
	fmt.Fprintf(w, "tier:        %s\n", Tier(backend, s))
	if s.Persist {
		fmt.Fprintf(w, "durable:     %s\n", Durable(s))
	}
	if s.LastOpen != 0 {
		last := time.Unix(0, s.LastOpen)
		fmt.Fprintf(w, "last open:   %s (%s ago)\n", last.Format(time.RFC3339), age(time.Since(last)))
	}
	created := time.Unix(0, s.Created)
	fmt.Fprintf(w, "created:     %s (%s ago)\n", created.Format(time.RFC3339), age(time.Since(created)))
	fmt.Fprintf(w, "lifetime:    %s\n", Lifetime(s))
	if ch := s.Channel; ch != nil {
		fmt.Fprintf(w, "channel:     %d slots of %s (every %s)\n", ch.Slots, bytesize.Format(ch.SlotBytes), bytesize.Format(ch.SlotStride))
	}
	if s.Uncommitted {
		fmt.Fprintf(w, "incomplete:  still being written; opens and 'gpushm get' refuse it until its writer commits it, and it goes if the writer ends first\n")
	}
	if s.Orphan != "" {
		fmt.Fprintf(w, "orphaned:    %s ('gpushm rm %s' frees it)\n", s.Orphan, s.Name)
	}
	if len(s.Meta) > 0 {
		fmt.Fprintf(w, "meta:        %s\n", s.Meta)
	}
}

// pids says which processes hold an earlier version.
func pids(ps []int) string {
	if len(ps) == 0 {
		return ""
	}
	s := fmt.Sprint(ps)
	return " by pid " + s[1:len(s)-1]
}

// Info writes what info prints: the daemon at socket, its processes,
// segments, pool and tiers, its devices, and the node's GPUs.
func Info(out io.Writer, inf *gpushm.Info, socket string) error {
	fmt.Fprintf(out, "daemon:   gpushm %s at %s\nbackend:  %s\n", inf.Server, socket, inf.Backend)
	fmt.Fprintf(out, "process:  serving %d, supervisor %d, %d restart(s)", inf.PID, inf.SupervisorPID, inf.Restarts)
	if inf.Grace > 0 {
		fmt.Fprintf(out, ", %s left to reclaim leases", inf.Grace.Round(100*time.Millisecond))
	}
	fmt.Fprintln(out)
	fmt.Fprintf(out, "segments: %d named, %d holding memory, %s allocated, %d opens\n",
		inf.Usage.Named, inf.Usage.Segments, bytesize.Format(inf.Usage.Bytes), inf.Usage.Opens)
	if p := inf.Pool; p != nil {
		// Counted as free below: a create takes it first.
		fmt.Fprintf(out, "pool:     %d allocations made ahead of time, %s\n", p.Ready, bytesize.Format(p.Bytes))
	}
	if t := inf.Tiers; t != nil {
		tiers(out, t, inf.Backend)
	}
	fmt.Fprintln(out)
	w := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(w, "DEVICE\tNAME\tUUID\tTOTAL\tFREE\tGRANULARITY")
	for _, d := range inf.Devices {
		fmt.Fprintf(w, "%d\t%s\t%s\t%s\t%s\t%s\n", d.Index, d.Name, orDash(d.UUID),
			bytesize.Format(int64(d.TotalBytes)), bytesize.Format(int64(d.FreeBytes)), bytesize.Format(d.Granularity))
	}
	if err := w.Flush(); err != nil {
		return err
	}
	return GPUs(out, inf.GPU)
}

// tiers writes info's lines on the tiers: what each device holds, and
// host memory.
func tiers(out io.Writer, t *gpushm.Tiers, backend string) {
	// Named as ls names them: a daemon serving host memory has no GPU.
	onDevice := Tier(backend, &gpushm.SegmentInfo{Tier: "gpu"})
	evicted := Tier(backend, &gpushm.SegmentInfo{Tier: "host"})
	back := "back on their GPU"
	if backend == "host" {
		back = "back in place"
	}
	for _, d := range t.Devices {
		budget := "no budget"
		if d.Budget > 0 {
			budget = "budget " + bytesize.Format(d.Budget)
		}
		fmt.Fprintf(out, "tier %s: device %d: %s on it, %s (peak %s)\n", onDevice, d.Device, bytesize.Format(d.Bytes), budget, bytesize.Format(d.Peak))
	}
	hostBudget := "eviction off (--host-budget 0)"
	if t.HostBudget > 0 {
		hostBudget = "budget " + bytesize.Format(t.HostBudget)
	}
	fmt.Fprintf(out, "tier %s: %s evicted, %s in copies of segments %s, %s; %d evictions (%s), %d restores (%s)\n",
		evicted, bytesize.Format(t.HostBytes), bytesize.Format(t.CleanBytes), back, hostBudget, t.Evictions,
		bytesize.Format(t.EvictedBytes), t.Restores, bytesize.Format(t.RestoredBytes))
	if t.ReserveTarget > 0 {
		fmt.Fprintf(out, "reserve:  %s of %s of host memory made ahead of evictions (--host-reserve); evictions served from it: %d\n",
			bytesize.Format(t.ReserveBytes), bytesize.Format(t.ReserveTarget), t.ReserveTakes)
	}
	if d := t.Disk; d != nil {
		budget := "no budget"
		if d.Budget > 0 {
			budget = "budget " + bytesize.Format(d.Budget)
		}
		fmt.Fprintf(out, "tier disk: %s in copies (%s); %d segments only there, %d durable; %d written (%s), %d read (%s)\n",
			bytesize.Format(d.Bytes), budget, d.Segments, d.Durable, d.Writes, bytesize.Format(d.WrittenBytes), d.Reads, bytesize.Format(d.ReadBytes))
	}
}

// GPUs writes the GPU part of info: where the figures come from, each
// GPU's memory and load, and the processes using it.
func GPUs(out io.Writer, r *gpushm.GPUReport) error {
	if r == nil {
		return nil // a daemon from before GPU reports
	}
	switch r.Source {
	case "nvml":
		fmt.Fprintf(out, "\nGPUs from NVML, driver %s\n", orDash(r.Driver))
	case "cuda":
		fmt.Fprintf(out, "\nGPUs from the CUDA driver (cuMemGetInfo): memory only\n")
	case "none":
		fmt.Fprintf(out, "\nGPUs: none reported\n")
	default:
		fmt.Fprintf(out, "\nGPUs from %s\n", r.Source)
	}
	if r.Note != "" {
		fmt.Fprintf(out, "note: %s\n", r.Note)
	}
	if len(r.GPUs) == 0 {
		return nil
	}
	w := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(w, "GPU\tDEVICE\tNAME\tUUID\tUSED\tTOTAL\tUTIL")
	procs := 0
	for _, g := range r.GPUs {
		dev, util := "-", "-"
		if g.Device != nil {
			dev = strconv.Itoa(*g.Device)
		}
		if g.Utilization != nil {
			util = strconv.Itoa(*g.Utilization) + "%"
		}
		fmt.Fprintf(w, "%d\t%s\t%s\t%s\t%s\t%s\t%s\n", g.Index, dev, g.Name, orDash(g.UUID),
			bytesize.Format(int64(g.UsedBytes)), bytesize.Format(int64(g.TotalBytes)), util)
		procs += len(g.Processes)
	}
	if err := w.Flush(); err != nil {
		return err
	}
	if procs == 0 {
		return nil
	}
	fmt.Fprintln(out)
	w = tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(w, "GPU\tPID\tUSER\tCOMMAND\tGPU MEMORY")
	for _, g := range r.GPUs {
		for _, p := range g.Processes {
			who := "-"
			if p.UID != nil {
				who = owner.User(*p.UID)
			}
			fmt.Fprintf(w, "%d\t%d\t%s\t%s\t%s\n", g.Index, p.PID, who, orDash(p.Command), bytesize.Format(int64(p.UsedBytes)))
		}
		if g.MoreProcesses > 0 {
			fmt.Fprintf(w, "%d\t...\t\t%d more\t\n", g.Index, g.MoreProcesses)
		}
	}
	return w.Flush()
}

// Version is what version says, as -o json prints it.
type Version struct {
	Client ClientVersion `json:"client"`
	// Daemon is nil when none answered; DaemonError says why.
	Daemon      *DaemonVersion `json:"daemon"`
	DaemonError string         `json:"daemon_error,omitempty"`
}

// ClientVersion is this binary's version, and how it was built.
type ClientVersion struct {
	Version  string `json:"version"`
	Go       string `json:"go"`
	Platform string `json:"platform"`
	// Commit is the revision built, when the build recorded it (go build
	// in a git checkout, without -buildvcs=false); Modified, that the
	// tree had changes.
	Commit   string `json:"commit,omitempty"`
	Modified bool   `json:"modified,omitempty"`
}

// DaemonVersion is the version of the daemon that answered, and where.
type DaemonVersion struct {
	Version string `json:"version"`
	Backend string `json:"backend"`
	Socket  string `json:"socket"`
	PID     int    `json:"pid"`
}

// Client is this binary's ClientVersion: version, and what the build
// recorded.
func Client(version string) ClientVersion {
	v := ClientVersion{Version: version, Go: runtime.Version(), Platform: runtime.GOOS + "/" + runtime.GOARCH}
	if bi, ok := debug.ReadBuildInfo(); ok {
		for _, s := range bi.Settings {
			switch s.Key {
			case "vcs.revision":
				v.Commit = s.Value
			case "vcs.modified":
				v.Modified = s.Value == "true"
			}
		}
	}
	return v
}

// Write writes v as version prints it: the client's line, then the
// daemon's.
func (v Version) Write(w io.Writer) {
	commit := ""
	if v.Client.Commit != "" {
		commit = ", commit " + v.Client.Commit
		if v.Client.Modified {
			commit += " (modified)"
		}
	}
	fmt.Fprintf(w, "client:  gpushm %s (%s, %s%s)\n", v.Client.Version, v.Client.Go, v.Client.Platform, commit)
	if d := v.Daemon; d != nil {
		fmt.Fprintf(w, "daemon:  gpushm %s, backend %s, pid %d, at %s\n", d.Version, d.Backend, d.PID, d.Socket)
	} else {
		fmt.Fprintf(w, "daemon:  none answered: %s\n", v.DaemonError)
	}
}
