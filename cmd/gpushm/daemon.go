package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"runtime"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"

	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/gpushm/gpushm/internal/backend"
	"github.com/gpushm/gpushm/internal/channel"
	"github.com/gpushm/gpushm/internal/cuda"
	"github.com/gpushm/gpushm/internal/epoch"
	"github.com/gpushm/gpushm/internal/fusefs"
	"github.com/gpushm/gpushm/internal/metrics"
	"github.com/gpushm/gpushm/internal/nvml"
	"github.com/gpushm/gpushm/internal/segment"
	"github.com/gpushm/gpushm/internal/server"
	"github.com/gpushm/gpushm/internal/supervisor"
	"github.com/gpushm/gpushm/internal/wire"
)

func daemonCmd() *cobra.Command {
	var (
		backendName string
		devices     string
		device      int
		logLevel    string
		spin        time.Duration
		o           daemonOptions
	)
	cmd := &cobra.Command{
		Use:   "daemon",
		Short: "Run the daemon that owns the segments",
		Long: `Run the gpushm daemon in the foreground.

The process you start is a small supervisor: it holds every segment's
memory descriptor and the listening socket, and runs the serving process
(the same binary), which answers clients, talks to CUDA and serves the
FUSE view. If the serving process dies (a crash, the OOM killer, kill -9),
the supervisor starts a new one with every segment, owner, mode and meta
data as they were; clients reconnect on their own and reclaim their leases
and temporary segments within --grace. Nothing acknowledged is lost. The
serving process holds the same descriptors: if the supervisor dies, the
serving process starts a new one (in a session of its own) and hands it
everything, and clients notice nothing; 'gpushm info' names the new one.
So SIGKILL of the supervisor does not stop the daemon: SIGTERM does.

Signals to the supervisor's pid:
  SIGHUP           upgrade: start the binary now on disk as the new serving
                   process; it takes over the socket, every segment and every
                   client connection, without dropping one
  SIGTERM, SIGINT  stop for good: stop serving and free every segment
To restart without losing segments, send SIGHUP (or kill the serving process,
whose pid 'gpushm info' shows); to stop for good, send SIGTERM. Under systemd
(deploy/systemd, 'gpushm install-systemd') 'systemctl reload' upgrades,
'systemctl restart' keeps every segment in systemd's fd store, and
'systemctl stop' frees them; there systemd, not the serving process,
restarts a supervisor that died.

Limits are on by default, so that no user can starve the others: each
user other than root may hold --user-connections connections,
--user-segments segments and --user-quota bytes, and the daemon as a whole
--max-segments segments and --max-connections connections, sized from its
descriptor limit (raised to the hard limit at start). The daemon's own
limits (--max-segments, --max-connections, --max-memory) are shared
fairly, so that no group of users at their limits can lock out another
user, or root: once half of one is in use, a user above its fair share
(what lies below the top eighth, in equal parts among the users holding
some) waits; the top eighth is kept for users holding little, each up to
an eighth of it, and the top thirty-second for root. A request over a
limit is refused with an error naming the limit and its numbers
(docs/security.md).

--backend auto (the default) uses CUDA when libcuda.so.1 loads and a device
with VMM and POSIX file descriptor handles is present, and host memory
(memfd) otherwise. It refuses to start when another daemon serves the
socket, and replaces a stale socket file.`,
		Example: `  gpushm daemon                                  # CUDA when a GPU is there, else host memory
  gpushm daemon --backend host --socket /tmp/gpushm.sock
  gpushm daemon --gpu-budget 80% --metrics-listen 127.0.0.1:9464
  sudo gpushm install-systemd --enable           # under systemd instead`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			var lvl slog.Level
			if err := lvl.UnmarshalText([]byte(logLevel)); err != nil {
				return fmt.Errorf("--log-level: %w", err)
			}
			log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: lvl}))
			if cmd.Flags().Changed("device") {
				if cmd.Flags().Changed("devices") {
					return fmt.Errorf("give --device or --devices, not both")
				}
				devices = strconv.Itoa(device)
			}
			if o.grace < 0 {
				return fmt.Errorf("--grace %s: want 0 or more", o.grace)
			}
			o.backend, o.devices, o.spin = backendName, devices, spin
			o.nofile = raiseNOFILE()
			// Named for ps and pgrep (supervisor/name.go): one started
			// through /proc/self/exe would be "exe".
			switch {
			case supervisor.Attached():
				supervisor.SetName(supervisor.ServingName)
				return runServing(cmd.Context(), log.With("role", "server"), o, true)
			case supervisor.Adopting():
				supervisor.SetName(supervisor.SupervisorName)
				return runAdoptive(cmd.Context(), log.With("role", "supervisor"), o)
			case o.supervise:
				supervisor.SetName(supervisor.SupervisorName)
				return runSupervisor(cmd.Context(), log.With("role", "supervisor"), o)
			}
			return runServing(cmd.Context(), log, o, false)
		},
	}
	f := cmd.Flags()
	f.StringVar(&backendName, "backend", "auto", "memory backend: auto, cuda or host")
	f.StringVar(&devices, "devices", "all", "GPUs to serve: all, or ordinals and UUIDs separated by commas (0,1 or GPU-5e6f...)")
	f.IntVar(&device, "device", 0, "serve only this GPU ordinal (short for --devices N)")
	f.StringVar(&logLevel, "log-level", "info", "log level: debug, info, warn or error")
	f.StringVar(&o.socketGroup, "socket-group", "", "let only this group connect (socket mode 0660; default: every user, 0666)")
	f.StringVar(&o.maxMemory, "max-memory", "", "cap what segments may hold on each device, for all users and root, shared fairly as --max-segments is: a size (64G) or a share of the device (90%)")
	f.StringVar(&o.userQuota, "user-quota", "auto", "cap the bytes each non-root user's segments may hold: a share of each device (30%), a size for all devices together (64G), 0 (no cap), or auto: 50% of each GPU, 25% of host memory")
	f.StringVar(&o.userSegments, "user-segments", "auto", "cap how many segments each non-root user may hold: a number, 0 (no cap), or auto: 4096 (or a quarter of --max-segments, if less)")
	f.StringVar(&o.userConnections, "user-connections", "auto", "cap how many connections each non-root user may hold open: a number, 0 (no cap), or auto: 1024 (or a quarter of --max-connections, if less)")
	f.StringVar(&o.maxSegments, "max-segments", "auto", "cap the segments the daemon holds, for all users and root (a channel counts as 2), shared fairly: past half, users above their fair share wait, the top eighth is for users holding few and the top thirty-second for root: a number, 0 (no cap), or auto: half the descriptor limit (ulimit -n), and under systemd no more than its file descriptor store keeps (FileDescriptorStoreMax= less 4)")
	f.StringVar(&o.maxConnections, "max-connections", "auto", "cap the connections the daemon serves, for all users and root, shared fairly as --max-segments is: a number, 0 (no cap), or auto: the descriptor limit less --max-segments and a sixteenth kept for the daemon")
	f.StringVar(&o.createPool, "create-pool", "auto", "make allocations ahead of creates of sizes asked for before, so a create need not wait for the driver (docs/architecture.md): bytes a device (256M), 0 (none), or auto: 2% of each GPU, 1% of host memory")
	f.StringVar(&o.gpuBudget, "gpu-budget", "auto", "bound the bytes of segments on each GPU; past it, creates and restores first evict the least recently opened segments nobody holds to host memory (docs/architecture.md, \"Tiers\"): a size (24GiB), a share of each GPU (80%), 0 (no budget), or auto: each GPU's memory less a sixteenth, at least 2 GiB, for the CUDA contexts and own memory of the processes using it (no budget on the host backend)")
	f.StringVar(&o.hostBudget, "host-budget", "auto", "bound the bytes evicted to host memory; past it, eviction stops and creates that need room fail with ENOSPC: a size (64GiB), a share of host memory (50%), 0 (never evict), or auto: half of host memory")
	f.StringVar(&o.hostReserve, "host-reserve", "auto", "keep this much host memory made ahead of evictions, so that a first eviction copies at the copy engine's speed instead of waiting for the kernel to make its pages; made in the background at the lowest priority once the daemon serves, in pieces of halving sizes (an eviction of up to half of it takes one), on huge pages where the machine has them free, and given back while available memory is below a sixteenth of host memory (docs/architecture.md, \"Tiers\"): a size (32GiB), a share of host memory (10%), 0 (none), or auto: the largest GPU budget, at most an eighth of host memory and the host budget (none on the host backend)")
	f.StringVar(&o.metrics, "metrics-listen", "", "serve Prometheus metrics at http://ADDR/metrics (e.g. 127.0.0.1:9464)")
	f.StringVar(&o.mount, "mount", "", "also serve the segments as files in this directory (FUSE; see docs/fuse.md)")
	f.StringVar(&o.rdma, "rdma", "auto", "make GPU memory that RDMA engines (NIXL, UCX, Mooncake) can register: auto (on devices that allow it with VMM allocations) or off")
	f.StringVar(&o.nvml, "nvml", "auto", "GPU figures for info and metrics from NVML: auto (when libnvidia-ml.so.1 loads and works), require (refuse to start without it) or off")
	f.StringVar(&o.nvmlLibrary, "nvml-library", nvml.Library, "the NVML library to load (a name for the loader, or a path)")
	f.DurationVar(&spin, "spin", 50*time.Microsecond, "how long each connection polls for its next request before sleeping (0 disables; off below 4 cores): a little CPU for latency")
	f.BoolVar(&o.supervise, "supervise", true, "run a supervisor that keeps every segment across crashes and upgrades of the serving process (false: one process; its death frees everything)")
	f.DurationVar(&o.grace, "grace", 10*time.Second, "after a restart, how long clients have to reclaim their leases and temporary segments")
	f.BoolVar(&o.fdStore, "fd-store", false, "also keep everything in systemd's file descriptor store, so that a restart of the whole service loses nothing (on by itself when systemd sets $FDSTORE)")
	return cmd
}

type daemonOptions struct {
	// rdma is auto or off: whether cuda allocations are made
	// gpuDirectRDMACapable where the device allows it.
	rdma        string
	backend     string
	devices     string
	spin        time.Duration
	socketGroup string
	metrics     string
	mount       string
	maxMemory   string
	userQuota   string
	createPool  string
	gpuBudget   string
	hostBudget  string
	hostReserve string
	// Count limits: a number, "auto" or "0" (limits.go).
	userSegments, userConnections string
	maxSegments, maxConnections   string
	supervise                     bool
	grace                         time.Duration
	fdStore                       bool
	// nvml is auto, require or off; nvmlLibrary what to dlopen.
	nvml, nvmlLibrary string
	// nofile is the process's descriptor limit, raised to its hard limit.
	nofile int
}

// runSupervisor holds the socket, the epoch page and every segment's
// descriptor, and runs the serving process (this binary again) under
// internal/supervisor.
func runSupervisor(ctx context.Context, log *slog.Logger, o daemonOptions) error {
	path := socketPath()
	lock, err := server.Lock(path)
	if err != nil {
		return fmt.Errorf("%w (stop it first, or pick another --socket)", err)
	}
	defer lock.Close()
	handed := supervisor.FromSystemd(log)
	listener := handed.Listener
	if listener == nil {
		ln, err := server.Listen(path, o.socketGroup)
		if errors.Is(err, server.ErrRunning) {
			return fmt.Errorf("%w (stop it first, or pick another --socket)", err)
		}
		if err != nil {
			return err
		}
		listener, err = ln.File()
		ln.Close()
		if err != nil {
			return err
		}
	}
	defer listener.Close()
	page := handed.Epoch
	if page == nil {
		ep, err := epoch.New()
		if err != nil {
			return err
		}
		page = os.NewFile(uintptr(ep.FD()), "epoch")
	}
	defer page.Close()
	exe, err := os.Executable()
	if err != nil {
		return fmt.Errorf("find this binary to run it as the serving process: %w", err)
	}
	store := o.fdStore || supervisor.StoreWanted()
	if store {
		passStoreMax()
	}
	sup := supervisor.New(supervisor.Config{
		Exe: exe, Args: os.Args[1:], Listener: listener, Epoch: page,
		Grace: o.grace, Store: store, Log: log,
		// Under systemd, systemd restarts the service when the supervisor
		// dies (and its fd store keeps the segments): a supervisor the
		// serving process started would be killed with the unit's cgroup.
		Lock: lock, Heal: !store && os.Getenv("NOTIFY_SOCKET") == "",
	}, handed.State)
	log.Debug("supervising", "socket", path, "pid", os.Getpid(), "exe", exe, "fd_store", store)
	return supervise(ctx, sup, log, path, listener, store)
}

// supervise runs sup until the daemon stops, and removes the socket file
// then.
func supervise(ctx context.Context, sup *supervisor.Supervisor, log *slog.Logger, path string, listener *os.File, store bool) error {
	err := sup.Run(ctx)
	if errors.Is(err, supervisor.ErrHandover) {
		// The serving process lives on, with the socket, and starts
		// another supervisor.
		return err
	}
	var se *supervisor.StartError
	if errors.As(err, &se) {
		// The serving process said why on standard error.
		log.Debug("first serving process failed", "err", se.Err)
		err = exitCode(se.Code)
	}
	if !store {
		// The socket goes with the daemon; under systemd's store it stays,
		// since the stored listener is bound to it.
		removeSocket(path, listener)
	}
	return err
}

// removeSocket removes the socket file if it is still the one listener is
// bound to.
func removeSocket(path string, listener *os.File) {
	st, err := os.Stat(path)
	if err != nil {
		return
	}
	var ls syscall.Stat_t
	if syscall.Stat(path, &ls) == nil && st.Mode()&os.ModeSocket != 0 {
		name, err := syscall.Getsockname(int(listener.Fd()))
		if sa, ok := name.(*syscall.SockaddrUnix); err == nil && ok && sa.Name == path {
			os.Remove(path)
		}
	}
}

// runServing serves clients: as the serving process of a supervisor
// (supervised), or alone.
func runServing(ctx context.Context, log *slog.Logger, o daemonOptions, supervised bool) error {
	switch o.rdma {
	case "auto":
	case "off":
		cuda.DisableRDMA()
	default:
		return fmt.Errorf("--rdma %q: want auto or off", o.rdma)
	}
	b, err := backend.Open(o.backend, o.devices, log)
	if err != nil {
		return err
	}
	defer b.Close()
	pool, err := o.poolBytes(b)
	if err != nil {
		return err
	}
	b.Pool(pool)
	srv, err := server.New(b, log, version)
	if err != nil {
		return err
	}
	lim, err := o.limits(b, o.nofile, storeMax())
	if err != nil {
		return err
	}
	srv.Registry().SetLimits(lim.seg)
	srv.SetConnLimits(lim.conn)
	// Channels' control blocks are host memory whatever the backend.
	host, err := backend.NewHost()
	if err != nil {
		return err
	}
	srv.Registry().SetControlAllocator(host)
	spill, err := newSpill(host)
	if err != nil {
		return err
	}
	tiers, err := o.tiers(b, host, spill)
	if err != nil {
		return err
	}
	tiers.Observe = srv.ObserveMove
	srv.Registry().SetTiers(tiers)
	reserve, err := o.reserveBytes(b, host, tiers)
	if err != nil {
		return err
	}
	spin := o.spin
	if spin > 0 && runtime.NumCPU() < 4 {
		// Polling would take the core the client needs.
		log.Debug("not spinning: fewer than 4 cores", "cores", runtime.NumCPU())
		spin = 0
	}
	srv.SetSpin(spin)
	gpus, closeGPUs, err := openGPUMonitor(o.nvml, o.nvmlLibrary, b, log)
	if err != nil {
		return err
	}
	defer closeGPUs()
	srv.SetGPUReport(gpus.ReportFor)
	// Bind the metrics port before serving: a client that finds the
	// daemon finds one with every part it was asked to serve, and a port
	// in use is an error at start, not a daemon without metrics. A
	// serving process binds it after the restore instead, since in an
	// upgrade its predecessor lets go of it only then; it fails its start
	// all the same.
	var mln net.Listener
	if !supervised {
		if mln, err = listenMetrics(o.metrics); err != nil {
			return err
		}
	}

	var (
		ln   *net.UnixListener
		link *supervisor.Link
	)
	path := socketPath()
	if supervised {
		var epochFD int
		link, ln, epochFD, err = supervisor.Attach()
		if err != nil {
			return err
		}
		page, err := epoch.Open(epochFD)
		if err != nil {
			return err
		}
		srv.SetEpoch(page)
		if err := link.Initialized(); err != nil {
			return err
		}
		start, err := link.Receive()
		if err != nil {
			return err
		}
		srv.Registry().SetJournal(link)
		restore(srv, b, host, start, log)
		srv.SetSupervisor(start.SupervisorPID, start.Restarts)
		srv.StartGrace(start.GraceUntil)
		if start.Heal {
			link.Heal(supervisor.Healing{
				Replay:   srv.Registry().Replay,
				Adopted:  func(pid int) { srv.SetSupervisor(pid, start.Restarts) },
				Restarts: start.Restarts,
				Log:      log,
			})
		}
	} else {
		lock, err := server.Lock(path)
		if err != nil {
			return fmt.Errorf("%w (stop it first, or pick another --socket)", err)
		}
		defer lock.Close()
		ln, err = server.Listen(path, o.socketGroup)
		if errors.Is(err, server.ErrRunning) {
			closeListener(mln)
			return fmt.Errorf("%w (stop it first, or pick another --socket)", err)
		}
		if err != nil {
			closeListener(mln)
			return err
		}
	}

	serveCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	ex := &extras{o: o, log: log, srv: srv, b: b, gpus: gpus.Report, mln: mln}
	if err := ex.start(); err != nil {
		ln.Close()
		if !supervised {
			os.Remove(path) // ours: Listen made it, and nobody was served
		}
		return err
	}
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM)
	defer signal.Stop(sigs)
	go func() {
		select {
		case <-sigs:
		case <-serveCtx.Done():
			return
		}
		// Unmount before Serve closes the registry, so that no FUSE request
		// meets a closed one.
		ex.stop()
		if supervised {
			// A signal to the serving process itself (not the supervisor's
			// stop) ends it as a crash would: connections are not closed
			// one by one, so their temporary segments stay for their
			// clients to reclaim from the successor.
			log.Warn("serving process signalled; exiting for the supervisor to restart it")
			os.Exit(0)
		}
		cancel()
	}()
	defer ex.stop()

	log.Info("serving", "socket", path, "backend", b.Name(), "version", version, "pid", os.Getpid(), "max_fds", o.nofile)
	logLimits(log, lim)
	if link != nil {
		if err := link.Ready(); err != nil {
			return err
		}
		go follow(link, srv, ln, ex, cancel, log)
	}
	// The reserve is made in the background once clients can be served,
	// and freed when serving ends.
	var reserving sync.WaitGroup
	defer func() {
		cancel()
		reserving.Wait()
	}()
	if reserve > 0 {
		reserving.Go(func() { spill.Reserve(serveCtx, reserve, log) })
	}
	if err := srv.Serve(serveCtx, ln, supervised); err != nil {
		return err
	}
	log.Info("stopped")
	return nil
}

// restore rebuilds the registry from what the supervisor held, checking
// each descriptor with the backend, and adopts the connections a
// predecessor parked.
func restore(srv *server.Server, b backend.Backend, host *backend.Host, start *supervisor.Start, log *slog.Logger) {
	items := make([]segment.Restored, 0, len(start.Segments))
	now := time.Now().UnixNano()
	// An orphan without a record is dated now and owned by root (0600).
	unknown := segment.Record{Created: now, Modified: now, Mode: 0o600}
	for _, h := range start.Segments {
		it := segment.Restored{Record: unknown}
		it.Record.ID = h.ID
		if h.Rec == nil {
			it.Problem = "a memory descriptor came back without a record"
		} else if err := json.Unmarshal(h.Rec, &it.Record); err != nil || it.Record.ID != h.ID {
			it.Record = unknown
			it.Record.ID = h.ID
			it.Problem = fmt.Sprintf("its record is unreadable: %.200s", h.Rec)
		}
		if h.FD >= 0 {
			alloc := it.Record.Alloc
			if alloc == 0 && it.Problem == "" {
				it.Problem = "a memory descriptor came back for a segment without memory"
			}
			if alloc == 0 {
				alloc = 1 // an orphan: anything mappable will do to hold it
			}
			var (
				mem segment.Memory
				err error
			)
			if it.Record.OnHost() {
				// Evicted: a memfd whatever the backend.
				mem, err = host.Restore(0, h.FD, alloc)
			} else {
				mem, err = b.Restore(it.Record.Device, h.FD, alloc)
			}
			if err != nil {
				if it.Problem == "" {
					it.Problem = "its memory descriptor is not usable: " + err.Error()
				}
				mem = rawMemory{fd: h.FD, size: alloc}
			}
			it.Memory = mem
		}
		if it.Record.Slots > 0 || h.CtlFD >= 0 {
			it.Memory, it.Problem = restoreChannel(host, it, h.CtlFD)
		}
		items = append(items, it)
	}
	reg := srv.Registry()
	orphans := reg.Restore(items, start.NextID, time.Until(start.GraceUntil))
	for _, name := range orphans {
		inf, _ := reg.Stat(name)
		log.Error("kept a segment that cannot be served; 'gpushm rm' frees it", "name", name, "why", inf.Orphan)
	}
	for _, p := range start.Conns {
		if err := srv.Adopt(p.FD, p.State); err != nil {
			log.Error("adopt a connection", "err", err)
		}
	}
	srv.RepairChannels()
	log.Info("restored", "reason", start.Reason, "segments", len(start.Segments), "connections", len(start.Conns), "orphans", len(orphans))
}

// restoreChannel puts a channel's memory together again: its slots and its
// control block, which must both be there and check out.
func restoreChannel(host *backend.Host, it segment.Restored, ctlFD int) (segment.Memory, string) {
	problem := it.Problem
	var ctl segment.Memory
	if ctlFD >= 0 {
		m, err := host.Restore(0, ctlFD, segment.ControlBytes)
		if err == nil && it.Record.Slots > 0 {
			if err = checkControl(ctlFD, it.Record); err != nil {
				m = nil
			}
		}
		if err != nil {
			if problem == "" {
				problem = "its control block is not usable: " + err.Error()
			}
			m = rawMemory{fd: ctlFD, size: segment.ControlBytes}
		}
		ctl = m
	} else if problem == "" {
		problem = "its control block is missing"
	}
	if it.Record.Slots == 0 && problem == "" {
		problem = "a control block came back for a segment that is not a channel"
	}
	switch {
	case it.Memory == nil && ctl == nil:
		return nil, problem
	case it.Memory == nil:
		return ctl, problem
	case ctl == nil:
		return it.Memory, problem
	}
	return &segment.ChannelMemory{Data: it.Memory, Control: ctl}, problem
}

// checkControl checks that the control block at fd describes the channel
// rec records: a block of another layout is another channel's.
func checkControl(fd int, rec segment.Record) error {
	b, err := unix.Mmap(fd, 0, channel.BlockBytes, unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return fmt.Errorf("map: %w", err)
	}
	defer unix.Munmap(b)
	blk, err := channel.Map(b)
	if err != nil {
		return err
	}
	slots, slotBytes, _, err := blk.Check()
	if err != nil {
		return err
	}
	if slots != rec.Slots || slotBytes != rec.SlotBytes {
		return fmt.Errorf("it describes %d slots of %d bytes, the record %d slots of %d bytes", slots, slotBytes, rec.Slots, rec.SlotBytes)
	}
	return nil
}

// rawMemory holds a descriptor the backend could not use: an orphan's
// memory, kept (not freed) until removed. Its size is what the record
// says, so that the record journaled for the orphan still says it has
// memory and the supervisor goes on holding the descriptor.
type rawMemory struct {
	fd   int
	size int64
}

func (m rawMemory) FD() (int, error) { return m.fd, nil }
func (m rawMemory) Size() int64      { return m.size }
func (m rawMemory) Free() error      { return syscall.Close(m.fd) }

// follow carries out the supervisor's commands.
func follow(link *supervisor.Link, srv *server.Server, ln *net.UnixListener, ex *extras, cancel context.CancelFunc, log *slog.Logger) {
	for cmd := range link.Commands() {
		switch cmd {
		case "quiesce":
			ex.stop()
			conns, err := srv.Park()
			if err != nil {
				log.Error("park", "err", err)
			}
			for _, c := range conns {
				if err := link.SendConn(c.FD, c.State); err != nil {
					log.Error("hand over a connection", "err", err)
				}
			}
			srv.Registry().Detach()
			link.Quiesced()
			log.Info("handed over", "connections", len(conns))
		case "resume":
			srv.Registry().SetJournal(link)
			srv.Resume()
			if err := ex.start(); err != nil {
				log.Error("resume", "err", err)
			}
			link.Ready()
		case "exit":
			cancel()
		case "stop":
			ex.stop()
			cancel()
		}
	}
}

// extras are the parts of the daemon beside the socket: metrics and the
// FUSE view. A serving process that hands over stops them first, so that
// its successor can bind the port and mount the view.
type extras struct {
	o   daemonOptions
	log *slog.Logger
	srv *server.Server
	b   backend.Backend

	gpus func() *wire.GPUReport // NVML's figures, for metrics
	mln  net.Listener           // the metrics port, bound at start; nil once used

	mu       sync.Mutex
	http     *http.Server
	view     *fusefs.Server
	observer bool
}

func (e *extras) start() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.o.metrics != "" && e.http == nil {
		m := metrics.New(e.b.Name(), struct {
			*segment.Registry
			backend.Backend
		}{e.srv.Registry(), e.b})
		m.SetGPUs(e.gpus)
		m.SetBuild(version)
		if !e.observer {
			e.srv.SetObserver(m)
			e.observer = true
		}
		mln := e.mln
		e.mln = nil
		if mln == nil {
			// Serving again after a failed handover: bind again.
			var err error
			if mln, err = listenRetry(e.o.metrics); err != nil {
				return err
			}
		}
		mux := http.NewServeMux()
		mux.Handle("/metrics", promhttp.HandlerFor(m.Registry(), promhttp.HandlerOpts{}))
		e.http = &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
		go e.http.Serve(mln)
		e.log.Info("metrics", "url", "http://"+mln.Addr().String()+"/metrics")
	}
	if e.o.mount != "" && e.view == nil {
		view, err := fusefs.Mount(e.o.mount, e.srv.Registry(), e.b, e.log)
		if err != nil {
			if e.http != nil {
				e.http.Close()
				e.http = nil
			}
			return err
		}
		e.view = view
		e.log.Info("FUSE view", "mount", e.o.mount)
	}
	return nil
}

func (e *extras) stop() {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.view != nil {
		if err := e.view.Unmount(); err != nil {
			e.log.Error("unmount FUSE view", "err", err)
		}
		e.view = nil
	}
	if e.http != nil {
		e.http.Close()
		e.http = nil
	}
}

// listenRetry binds addr, waiting a moment for a predecessor to let go of
// it.
func listenRetry(addr string) (net.Listener, error) {
	for i := 0; ; i++ {
		ln, err := net.Listen("tcp", addr)
		if err == nil {
			return ln, nil
		}
		if !errors.Is(err, syscall.EADDRINUSE) || i == 50 {
			return listenMetrics(addr) // its error says what to do
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// logLimits says which limits are in force.
func logLimits(log *slog.Logger, l daemonLimits) {
	args := []any{"max_segments", l.seg.Segments, "max_connections", l.conn.Total,
		"user_segments", l.seg.UserSegments, "user_connections", l.conn.PerUser}
	if l.seg.UserBytes > 0 {
		args = append(args, "user_bytes", l.seg.UserBytes)
	}
	for d, n := range l.seg.UserDeviceBytes {
		args = append(args, "user_bytes_device_"+strconv.Itoa(d), n)
	}
	if l.shareNote != "" {
		args = append(args, "user_quota", l.shareNote)
	}
	for d, n := range l.seg.DeviceBytes {
		args = append(args, "max_bytes_device_"+strconv.Itoa(d), n)
	}
	log.Info("limits", args...)
	if l.storeNote != "" {
		log.Warn(l.storeNote)
	}
	if l.seg.Segments == 0 {
		log.Warn("no --max-segments: the supervisor, which holds a descriptor of every segment, may run out of descriptors")
	}
}
