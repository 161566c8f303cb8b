package daemon

import (
	"context"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/gpushm/gpushm/internal/backend"
	"github.com/gpushm/gpushm/internal/fusefs"
	"github.com/gpushm/gpushm/internal/metrics"
	"github.com/gpushm/gpushm/internal/segment"
	"github.com/gpushm/gpushm/internal/server"
	"github.com/gpushm/gpushm/internal/supervisor"
	"github.com/gpushm/gpushm/internal/wire"
)

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
	o   Options
	log *slog.Logger
	srv *server.Server
	b   backend.Backend

	gpus func() *wire.GPUReport // NVML's figures, for metrics
	mln  net.Listener           // the metrics port, bound at start; nil once used

	peers *peers // nil: no peers configured

	mu       sync.Mutex
	http     *http.Server
	view     *fusefs.Server
	observer bool
}

func (e *extras) start() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.o.Metrics != "" && e.http == nil {
		m := metrics.New(e.b.Name(), struct {
			*segment.Registry
			backend.Backend
		}{e.srv.Registry(), e.b})
		m.SetGPUs(e.gpus)
		m.SetBuild(e.o.Version)
		if !e.observer {
			e.srv.SetObserver(m)
			e.observer = true
		}
		mln := e.mln
		e.mln = nil
		if mln == nil {
			// Serving again after a failed handover: bind again.
			var err error
			if mln, err = listenRetry(e.o.Metrics); err != nil {
				return err
			}
		}
		mux := http.NewServeMux()
		mux.Handle("/metrics", promhttp.HandlerFor(m.Registry(), promhttp.HandlerOpts{}))
		e.http = &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
		go e.http.Serve(mln)
		e.log.Info("metrics", "url", "http://"+mln.Addr().String()+"/metrics")
	}
	if e.peers != nil {
		if err := e.peers.start(e.srv); err != nil {
			if e.http != nil {
				e.http.Close()
				e.http = nil
			}
			return err
		}
	}
	if e.o.Mount != "" && e.view == nil {
		view, err := fusefs.Mount(e.o.Mount, e.srv.Registry(), e.b, e.log)
		if err != nil {
			if e.http != nil {
				e.http.Close()
				e.http = nil
			}
			if e.peers != nil {
				e.peers.stop()
			}
			return err
		}
		e.view = view
		e.log.Info("FUSE view", "mount", e.o.Mount)
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
	if e.peers != nil {
		e.peers.stop()
	}
}
