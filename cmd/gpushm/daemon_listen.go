package main

import (
	"errors"
	"fmt"
	"net"
	"syscall"
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
