package cli

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"time"

	"github.com/spf13/cobra"

	"github.com/gpushm/gpushm/internal/daemon"
	"github.com/gpushm/gpushm/internal/exitcode"
	"github.com/gpushm/gpushm/internal/pull"
)

func daemonCmd() *cobra.Command {
	var (
		backendName string
		devices     string
		device      int
		logLevel    string
		spin        time.Duration
		detached    bool
		logFile     string
		o           daemon.Options
	)
	cmd := &cobra.Command{
		Use:   "daemon",
		Short: "Run the daemon that owns the segments",
		Long:  daemonLong,
		Example: `  gpushm daemon                                  # CUDA when a GPU is there, else host memory
  gpushm daemon --detach                         # in the background; returns once it answers
  gpushm daemon --backend host --socket /tmp/gpushm.sock
  gpushm daemon --gpu-budget 80% --metrics-listen 127.0.0.1:9464
  sudo gpushm install-systemd --enable           # under systemd instead`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			var lvl slog.Level
			if err := lvl.UnmarshalText([]byte(logLevel)); err != nil {
				return fmt.Errorf("--log-level: %w", err)
			}
			if cmd.Flags().Changed("log-file") && logFile == "" {
				return exitcode.Usagef(cmd, "--log-file: want a path")
			}
			if detached && os.Getenv(detachedEnv) == "" {
				if logFile == "" {
					logFile = defaultDaemonLog()
				}
				return detach(cmd.Context(), socketPath(), o.Mount, logFile)
			}
			if cmd.Flags().Changed("log-file") && os.Getenv(detachedEnv) == "" {
				return exitcode.Usagef(cmd, "--log-file goes with --detach (in the foreground the log is standard error)")
			}
			log := slog.New(slog.NewTextHandler(Stderr, &slog.HandlerOptions{Level: lvl}))
			if cmd.Flags().Changed("device") {
				if cmd.Flags().Changed("devices") {
					return fmt.Errorf("give --device or --devices, not both")
				}
				devices = strconv.Itoa(device)
			}
			if o.Grace < 0 {
				return fmt.Errorf("--grace %s: want 0 or more", o.Grace)
			}
			o.Backend, o.Devices, o.Spin = backendName, devices, spin
			o.Socket, o.Version = socketPath(), version
			err := daemon.Run(cmd.Context(), log, o)
			var code daemon.ExitCode
			if errors.As(err, &code) {
				// The serving process said why on standard error.
				return exitcode.Code(code)
			}
			return err
		},
	}
	f := cmd.Flags()
	f.StringVar(&backendName, "backend", "auto", "memory backend: auto, cuda or host")
	f.StringVar(&devices, "devices", "all", "GPUs to serve: all, or ordinals and UUIDs separated by commas (0,1 or GPU-5e6f...)")
	f.IntVar(&device, "device", 0, "serve only this GPU ordinal (short for --devices N)")
	f.StringVar(&logLevel, "log-level", "info", "log level: debug, info, warn or error")
	f.BoolVar(&detached, "detach", false, "run in the background, in a session of its own, and return once it answers on the socket")
	f.StringVar(&logFile, "log-file", "", "with --detach: where the daemon's output goes (default $XDG_STATE_HOME/gpushm/daemon.log, else ~/.local/state/gpushm/daemon.log; root: /var/log/gpushm/daemon.log)")
	f.StringVar(&o.SocketGroup, "socket-group", "", "let only this group connect (socket mode 0660; default: every user, 0666)")
	f.StringVar(&o.MaxMemory, "max-memory", "", "cap what segments may hold on each device, for all users and root, shared fairly as --max-segments is: a size (64G) or a share of the device (90%)")
	f.StringVar(&o.UserQuota, "user-quota", "auto", "cap the bytes each non-root user's segments may hold: a share of each device (30%), a size for all devices together (64G), 0 (no cap), or auto: 50% of each GPU, 25% of host memory")
	f.StringVar(&o.UserSegments, "user-segments", "auto", "cap how many segments each non-root user may hold: a number, 0 (no cap), or auto: 4096 (or a quarter of --max-segments, if less)")
	f.StringVar(&o.UserConnections, "user-connections", "auto", "cap how many connections each non-root user may hold open: a number, 0 (no cap), or auto: 1024 (or a quarter of --max-connections, if less)")
	f.StringVar(&o.MaxSegments, "max-segments", "auto", "cap the segments the daemon holds, for all users and root (a channel counts as 2), shared fairly: past half, users above their fair share wait, the top quarter is for users holding few and the top thirty-second for root: a number, 0 (no cap), or auto: half the descriptor limit (ulimit -n), and under systemd no more than its file descriptor store keeps (FileDescriptorStoreMax= less 4)")
	f.StringVar(&o.MaxConnections, "max-connections", "auto", "cap the connections the daemon serves, for all users and root, shared fairly as --max-segments is: a number, 0 (no cap), or auto: the descriptor limit less --max-segments and a sixteenth kept for the daemon")
	f.StringVar(&o.CreatePool, "create-pool", "auto", "make allocations ahead of creates of sizes asked for before, so a create need not wait for the driver (docs/architecture.md): bytes a device (256M), 0 (none), or auto: 2% of each GPU, 1% of host memory")
	f.StringVar(&o.GPUBudget, "gpu-budget", "auto", "bound the bytes of segments on each GPU; past it, creates and restores first evict the least recently opened segments nobody holds to host memory (docs/architecture.md, \"Tiers\"): a size (24GiB), a share of each GPU (80%), 0 (no budget), or auto: each GPU's memory less a sixteenth, at least 2 GiB, for the CUDA contexts and own memory of the processes using it (no budget on the host backend)")
	f.StringVar(&o.HostBudget, "host-budget", "auto", "bound the bytes evicted to host memory; past it, eviction stops and creates that need room fail with ENOSPC: a size (64GiB), a share of host memory (50%), 0 (never evict), or auto: half of host memory")
	f.StringVar(&o.HostReserve, "host-reserve", "auto", "keep this much host memory made ahead of evictions, so that a first eviction copies at the copy engine's speed instead of waiting for the kernel to make its pages; made in the background at the lowest priority once the daemon serves, in pieces: one of four fifths of it (an eviction of up to that size takes it whole) and smaller ones, on huge pages where the machine has them free, and given back while available memory is below a sixteenth of host memory (docs/architecture.md, \"Tiers\"): a size (32GiB), a share of host memory (10%), 0 (none), or auto: five fourths of the largest GPU budget (taken at most as a seventh of host memory), so that the first eviction of a segment that large is served (at most the host budget; none on the host backend); beyond it, a piece the size of the largest segment on a GPU with no copy in host memory is made on demand")
	f.StringVar(&o.Disk, "disk", "", "a disk tier in these directories, one per drive, separated by commas: segments evicted past --host-budget go there, and durable segments (create --persist) keep a copy there that a daemon started after a reboot serves again (docs/disk.md); each directory is made 0700 if missing")
	f.StringVar(&o.DiskBudget, "disk-budget", "", "bound the bytes the disk tier's files take: a size (500GiB); none by default (a full disk is an error that keeps the segment in memory)")
	f.StringVar(&o.ListenPeers, "listen-peers", "", "let daemons on other nodes connect here (HOST:PORT or :PORT), authenticated by --peer-secret (docs/peers.md)")
	f.StringVar(&o.Peers, "peers", "", "daemons on other nodes to connect to, HOST:PORT separated by commas, authenticated by --peer-secret")
	f.StringVar(&o.PeerService, "peer-service", "", "daemons on other nodes to connect to: every address of this HOST:PORT (a Kubernetes headless Service's name), resolved every 30s, this node's own skipped, authenticated by --peer-secret")
	f.DurationVar(&o.PeerServiceEvery, "peer-service-every", 0, "how often --peer-service is resolved again (default 30s)")
	// A node that joins dials the others at once and they see it then;
	// this sets how soon they dial it back, which tests shorten.
	f.MarkHidden("peer-service-every")
	f.StringVar(&o.PeerSecret, "peer-secret", "", "the file (mode 0600, at least 32 bytes) of the secret this node's peers share; needed with --listen-peers, --peers or --peer-service")
	f.StringVar(&o.Node, "node", "", "this node's name to its peers (default: the host's name)")
	f.StringVar(&pull.HelperUser, "pull-helper-user", pull.HelperUser, "the user the pull helpers (the processes that move bytes over UCX) run as; the daemon must be root to start them so, and refuses to otherwise; '' runs them as the daemon's own user, which a helper taken over through UCX then is (docs/peers.md, \"Trust\")")
	f.DurationVar(&o.PullStall, "pull-stall", pull.DefaultStall, "how long a pull waits for a peer that sends nothing (a partition, a peer stopped) before it fails, naming the peer, and tries the next that offers the name")
	f.BoolVar(&o.PullMissing, "pull-missing", false, "let an open that waits for a name missing here (open with a wait, get --wait) have the daemon pull it from a peer that offers it: one pull a name, shared by every waiter, as 'gpushm pull' would make it (docs/peers.md)")
	f.StringVar(&o.Metrics, "metrics-listen", "", "serve Prometheus metrics at http://ADDR/metrics (e.g. 127.0.0.1:9464)")
	f.StringVar(&o.Mount, "mount", "", "also serve the segments as files in this directory (FUSE; see docs/fuse.md)")
	f.StringVar(&o.RDMA, "rdma", "auto", "make GPU memory that RDMA engines (NIXL, UCX, Mooncake) can register: auto (on devices that allow it with VMM allocations) or off")
	f.StringVar(&o.NVML, "nvml", "auto", "GPU figures for info and metrics from NVML: auto (when libnvidia-ml.so.1 loads and works), require (refuse to start without it) or off")
	f.StringVar(&o.NVMLLibrary, "nvml-library", daemon.NVMLLibrary, "the NVML library to load (a name for the loader, or a path)")
	f.DurationVar(&spin, "spin", 200*time.Microsecond, "how long a connection whose client asks again within it polls for the next request before sleeping (0 disables; off below 4 cores): a little CPU for latency")
	f.BoolVar(&o.Supervise, "supervise", true, "run a supervisor that keeps every segment across crashes and upgrades of the serving process (false: one process; its death frees everything)")
	f.DurationVar(&o.Grace, "grace", 10*time.Second, "after a restart, how long clients have to reclaim their leases and temporary segments")
	f.BoolVar(&o.FDStore, "fd-store", false, "also keep everything in systemd's file descriptor store, so that a restart of the whole service loses nothing (on by itself when systemd sets $FDSTORE)")
	return cmd
}

// daemonLong is daemon --help's text.
const daemonLong = `Run the gpushm daemon in the foreground, or with --detach in the background
of a session of its own: the command then returns once the daemon answers
(and, with --mount, once the files are there: what a script needs before
its next command; 'gpushm daemon &' returns at once, before it serves),
says its pid, and its output goes to --log-file
(default $XDG_STATE_HOME/gpushm/daemon.log, else
~/.local/state/gpushm/daemon.log; for root /var/log/gpushm/daemon.log). Stop it with SIGTERM to that pid
('gpushm info' shows it too).

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
(what lies below the top quarter, in equal parts among the users holding
some) waits; the top quarter is kept for users holding little, each
taking from it only while it holds at most a 128th of it (or 16
segments, 4 connections, where that leaves 8 users theirs), and the top
thirty-second for root. A request over a limit is refused with an error
naming the limit and its numbers (docs/security.md).

--backend auto (the default) uses CUDA when libcuda.so.1 loads and a device
with VMM and POSIX file descriptor handles is present, and host memory
(memfd) otherwise. It refuses to start when another daemon serves the
socket, and replaces a stale socket file.`
