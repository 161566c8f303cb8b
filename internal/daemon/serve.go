package daemon

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"runtime"
	"sync"
	"syscall"

	"github.com/gpushm/gpushm/internal/backend"
	"github.com/gpushm/gpushm/internal/cuda"
	"github.com/gpushm/gpushm/internal/epoch"
	"github.com/gpushm/gpushm/internal/peer"
	"github.com/gpushm/gpushm/internal/server"
	"github.com/gpushm/gpushm/internal/supervisor"
)

// serving is a serving process's parts, put together from Options before
// it serves.
type serving struct {
	o          Options
	log        *slog.Logger
	supervised bool

	b       backend.Backend
	host    *backend.Host // channels' control blocks and evicted segments
	spill   *backend.Spill
	srv     *server.Server
	lim     daemonLimits
	reserve int64        // --host-reserve, in bytes
	disk    *diskTier    // --disk; nil for none
	peers   *peer.Config // --listen-peers, --peers; nil for none
}

// Serve serves clients: as the serving process of a supervisor
// (supervised), or alone.
func Serve(ctx context.Context, log *slog.Logger, o Options, supervised bool) error {
	switch o.RDMA {
	case "auto":
	case "off":
		cuda.DisableRDMA()
	default:
		return fmt.Errorf("--rdma %q: want auto or off", o.RDMA)
	}
	b, err := backend.Open(o.Backend, o.Devices, log)
	if err != nil {
		return err
	}
	defer b.Close()
	s := &serving{o: o, log: log, supervised: supervised, b: b}
	if err := s.build(); err != nil {
		return err
	}
	gpus, closeGPUs, err := openGPUMonitor(o.NVML, o.NVMLLibrary, b, log)
	if err != nil {
		return err
	}
	defer closeGPUs()
	s.srv.SetGPUReport(gpus.ReportFor)
	// Bind the metrics port before serving: a client that finds the
	// daemon finds one with every part it was asked to serve, and a port
	// in use is an error at start, not a daemon without metrics. A
	// serving process binds it after the restore instead, since in an
	// upgrade its predecessor lets go of it only then; it fails its start
	// all the same.
	var mln net.Listener
	if !supervised {
		if mln, err = listenMetrics(o.Metrics); err != nil {
			return err
		}
	}
	var (
		ln   *net.UnixListener
		link *supervisor.Link
	)
	if supervised {
		ln, link, err = s.attach()
	} else {
		var lock io.Closer
		lock, ln, err = s.listen(mln)
		if lock != nil {
			defer lock.Close()
		}
		if err == nil && s.disk != nil {
			err = s.durable()
		}
	}
	if s.disk != nil {
		defer s.disk.close()
	}
	if err != nil {
		return err
	}
	ex := &extras{o: o, log: log, srv: s.srv, b: b, gpus: gpus.Report, mln: mln}
	if s.peers != nil {
		ex.peers = &peers{cfg: *s.peers, reg: s.srv.Registry(), device: b.DefaultDevice(), cuda: b.Name() == "cuda",
			pullMissing: o.PullMissing}
	}
	if err := ex.start(); err != nil {
		ln.Close()
		if !supervised {
			os.Remove(o.Socket) // ours: Listen made it, and nobody was served
		}
		return err
	}
	return s.serve(ctx, ln, link, ex)
}

// build makes the server over s.b, with its limits, pool, tiers and spin,
// and the host memory it evicts to.
func (s *serving) build() error {
	o, b := s.o, s.b
	pool, err := o.poolBytes(b)
	if err != nil {
		return err
	}
	b.Pool(pool)
	if s.srv, err = server.New(b, s.log, o.Version); err != nil {
		return err
	}
	if s.lim, err = o.limits(b, o.nofile, storeMax()); err != nil {
		return err
	}
	s.srv.Registry().SetLimits(s.lim.seg)
	s.srv.SetConnLimits(s.lim.conn)
	// Channels' control blocks are host memory whatever the backend.
	if s.host, err = backend.NewHost(); err != nil {
		return err
	}
	s.srv.Registry().SetControlAllocator(s.host)
	if s.spill, err = newSpill(s.host); err != nil {
		return err
	}
	tiers, err := o.tiers(b, s.host, s.spill)
	if err != nil {
		return err
	}
	tiers.Observe = s.srv.ObserveMove
	if s.peers, err = o.peerConfig(s.log); err != nil {
		return err
	}
	dirs, budget, err := o.diskOptions()
	if err != nil {
		return err
	}
	if len(dirs) > 0 {
		s.disk = newDiskTier(dirs, budget, s.log)
		tiers.Disk = s.disk
		tiers.Failed = func(op, name string, err error) {
			s.log.Error("a durable segment's write to disk failed; it stays in memory", "op", op, "name", name, "err", err)
		}
	}
	s.srv.Registry().SetTiers(tiers)
	if s.reserve, err = o.reserveBytes(b, s.host, tiers); err != nil {
		return err
	}
	spin := o.Spin
	if spin > 0 && runtime.NumCPU() < 4 {
		// Polling would take the core the client needs.
		s.log.Debug("not spinning: fewer than 4 cores", "cores", runtime.NumCPU())
		spin = 0
	}
	s.srv.SetSpin(spin)
	return nil
}

// attach takes the listener, the epoch page and every segment from the
// supervisor, and restores them.
func (s *serving) attach() (*net.UnixListener, *supervisor.Link, error) {
	link, ln, epochFD, err := supervisor.Attach()
	if err != nil {
		return nil, nil, err
	}
	page, err := epoch.Open(epochFD)
	if err != nil {
		return nil, nil, err
	}
	srv := s.srv
	srv.SetEpoch(page)
	if err := link.Initialized(); err != nil {
		return nil, nil, err
	}
	start, err := link.Receive()
	if err != nil {
		return nil, nil, err
	}
	srv.Registry().SetJournal(link)
	if err := restore(srv, s.b, s.host, s.disk, start, s.log); err != nil {
		return nil, nil, err
	}
	srv.SetSupervisor(start.SupervisorPID, start.Restarts)
	srv.StartGrace(start.GraceUntil)
	if start.Heal {
		link.Heal(supervisor.Healing{
			Replay:   srv.Registry().Replay,
			Adopted:  func(pid int) { srv.SetSupervisor(pid, start.Restarts) },
			Restarts: start.Restarts,
			Log:      s.log,
		})
	}
	return ln, link, nil
}

// listen locks the socket's path and listens on it, for a daemon without
// a supervisor; it closes mln, the metrics port, when it fails to listen.
// The lock it returns is held until the daemon stops.
func (s *serving) listen(mln net.Listener) (io.Closer, *net.UnixListener, error) {
	lock, err := server.Lock(s.o.Socket)
	if err != nil {
		return nil, nil, fmt.Errorf("%w (stop it first, or pick another --socket)", err)
	}
	ln, err := server.Listen(s.o.Socket, s.o.SocketGroup)
	if errors.Is(err, server.ErrRunning) {
		closeListener(mln)
		return lock, nil, fmt.Errorf("%w (stop it first, or pick another --socket)", err)
	}
	if err != nil {
		closeListener(mln)
		return lock, nil, err
	}
	return lock, ln, nil
}

// serve serves on ln until ctx is done, a signal stops the daemon, or the
// supervisor (link, when supervised) says so; it makes the host reserve
// in the background meanwhile.
func (s *serving) serve(ctx context.Context, ln *net.UnixListener, link *supervisor.Link, ex *extras) error {
	log, srv := s.log, s.srv
	serveCtx, cancel := context.WithCancel(ctx)
	defer cancel()
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
		if s.supervised {
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

	log.Info("serving", "socket", s.o.Socket, "backend", s.b.Name(), "version", s.o.Version, "pid", os.Getpid(), "max_fds", s.o.nofile)
	logLimits(log, s.lim)
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
	if s.reserve > 0 {
		if link != nil {
			s.spill.SetKeeper(link)
		}
		s.spill.SetDemand(srv.Registry().NextEviction)
		reserving.Go(func() { s.spill.Reserve(serveCtx, s.reserve, log) })
	}
	if err := srv.Serve(serveCtx, ln, s.supervised); err != nil {
		return err
	}
	log.Info("stopped")
	return nil
}
