package daemon

import (
	"errors"
	"fmt"
	"net"
	"syscall"
	"time"
)

// listenMetrics binds the --metrics-listen address, or returns nil when
// metrics are off. A port in use is an error at start: a daemon that
// serves without the metrics it was asked for would look healthy to every
// probe but the scraper's.
func listenMetrics(addr string) (net.Listener, error) {
	if addr == "" {
		return nil, nil
	}
	ln, err := net.Listen("tcp", addr)
	switch {
	case errors.Is(err, syscall.EADDRINUSE):
		return nil, fmt.Errorf("--metrics-listen %s: the port is in use (another gpushm daemon, or another exporter?); pick a free one", addr)
	case errors.Is(err, syscall.EACCES):
		return nil, fmt.Errorf("--metrics-listen %s: permission denied (ports below 1024 need root or CAP_NET_BIND_SERVICE)", addr)
	case err != nil:
		return nil, fmt.Errorf("--metrics-listen %s: %w", addr, err)
	}
	return ln, nil
}

func closeListener(ln net.Listener) {
	if ln != nil {
		ln.Close()
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
