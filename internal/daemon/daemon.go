// Package daemon composes the gpushm daemon: the serving process, which
// answers clients over the socket (internal/server) with memory from a
// backend (internal/backend), and the supervisor that holds every
// segment's descriptor across its restarts (internal/supervisor). The
// command 'gpushm daemon' fills Options from its flags and calls Run.
//
// Both processes are the same binary: Supervise runs the serving process
// as os.Executable with this process's arguments, and Run, called there
// again, finds the role it was started for (supervisor.Attached,
// supervisor.Adopting) and names the process for ps and pgrep.
package daemon

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/gpushm/gpushm/internal/nvml"
	"github.com/gpushm/gpushm/internal/supervisor"
)

// NVMLLibrary is the NVML library loaded when Options names none.
const NVMLLibrary = nvml.Library

// Options are the daemon's settings, one for each flag of 'gpushm daemon'
// (its help says what each means); sizes and counts are the flags' text,
// resolved for the node's devices when the serving process starts.
type Options struct {
	// Socket is where the daemon listens; Version what it reports.
	Socket, Version string
	// RDMA is auto or off: whether cuda allocations are made
	// gpuDirectRDMACapable where the device allows it.
	RDMA        string
	Backend     string
	Devices     string
	Spin        time.Duration
	SocketGroup string
	Metrics     string
	Mount       string
	MaxMemory   string
	UserQuota   string
	CreatePool  string
	GPUBudget   string
	HostBudget  string
	HostReserve string
	// Disk is the disk tier's directories, one per drive, separated by
	// commas (none: no disk tier); DiskBudget bounds what it takes.
	Disk, DiskBudget string
	// Peers (peers.go): ListenPeers is the address peers dial, Peers the
	// addresses this daemon dials (comma-separated), PeerService a
	// HOST:PORT whose every address is a peer, resolved again every
	// PeerServiceEvery, PeerSecret the file of the secret they share,
	// Node this node's name (default: the host's).
	ListenPeers, Peers, PeerService, PeerSecret, Node string
	PeerServiceEvery                                  time.Duration
	// PullStall is how long a pull waits for a peer that sends nothing
	// (0: pull.DefaultStall).
	PullStall time.Duration
	// PullMissing lets an open that waits for a name missing here have
	// the daemon pull it from a peer that offers it (pullmissing.go).
	PullMissing bool
	// Count limits: a number, "auto" or "0" (limits.go).
	UserSegments, UserConnections string
	MaxSegments, MaxConnections   string
	Supervise                     bool
	Grace                         time.Duration
	FDStore                       bool
	// NVML is auto, require or off; NVMLLibrary what to dlopen.
	NVML, NVMLLibrary string

	// nofile is the process's descriptor limit, raised to its hard limit
	// by Run.
	nofile int
}

// ExitCode is a daemon that ended with that status, having said why on
// standard error (a serving process that failed to start).
type ExitCode int

func (e ExitCode) Error() string { return fmt.Sprintf("exit status %d", int(e)) }

// Run runs the daemon process this one was started as: the serving
// process of a supervisor, a supervisor taking over from one that died, a
// first supervisor (o.Supervise), or a serving process alone.
func Run(ctx context.Context, log *slog.Logger, o Options) error {
	o.nofile = raiseNOFILE()
	// Named for ps and pgrep (supervisor/name.go): one started
	// through /proc/self/exe would be "exe".
	switch {
	case supervisor.Attached():
		supervisor.SetName(supervisor.ServingName)
		return Serve(ctx, log.With("role", "server"), o, true)
	case supervisor.Adopting():
		supervisor.SetName(supervisor.SupervisorName)
		return Adopt(ctx, log.With("role", "supervisor"), o)
	case o.Supervise:
		supervisor.SetName(supervisor.SupervisorName)
		return Supervise(ctx, log.With("role", "supervisor"), o)
	}
	return Serve(ctx, log, o, false)
}
