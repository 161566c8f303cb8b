// Package server serves the registry on a Unix SOCK_SEQPACKET socket.
//
// Each connection is authenticated once with SO_PEERCRED. Every open made on
// a connection is a lease recorded on that connection; when the connection
// ends, for whatever reason (close, crash, SIGKILL), its leases are released.
// The descriptors the server sends are the registry's, duplicated into the
// client by the kernel: the server never hands out ownership of its own.
//
// Lifetimes: Serve owns the listener, the workers and the goroutines it
// starts beside them (the refuser, the sweep, and those that answer a
// request set aside to wait). A connection has no goroutine of its own: a
// worker serves it while it is active, and an idle one waits in one epoll
// set holding none (workers.go says how). When ctx is done, Serve shuts
// every connection down and returns only after every connection has
// ended, every worker and goroutine it started has finished and the
// registry has been closed; a server that handed its connections over
// (Park) returns at once, freeing nothing.
//
// Where things are: server.go is the server and its accept loop; conn.go a
// connection (serve, send, flush, end); ops.go the dispatch, a table of
// one-line calls (handlers, one for each of wire.Operations, which its
// tests check), and a method per operation (opOpen, opCreate, ...), with
// the larger ones in files of their own (commit.go, copy.go, tier.go,
// waitversion.go, roles.go for a channel's roles); workers.go the
// workers and the idle set; connlimits.go the limits on connections,
// copylimits.go those on the copies of fill and dump; park.go the
// handover to a successor.
package server
