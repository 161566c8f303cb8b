// Package server serves the registry on a Unix SOCK_SEQPACKET socket.
//
// Each connection is authenticated once with SO_PEERCRED. Every open made on
// a connection is a lease recorded on that connection; when the connection
// ends, for whatever reason (close, crash, SIGKILL), its leases are released.
// The descriptors the server sends are the registry's, duplicated into the
// client by the kernel: the server never hands out ownership of its own.
//
// Lifetimes: Serve owns the listener and one goroutine per connection, and
// returns only after every connection goroutine has finished and the registry
// has been closed.
package server
