// Package peer is the control plane between gpushm daemons on different
// nodes: authenticated connections over TCP, on which each node calls
// operations of the others (list the segments a node offers; the daemon
// adds pull). The data itself moves over the transfer engine, never here.
//
// # Trust
//
// Every node holds the same secret (LoadSecret: a 0600 file of the
// daemon's user, at least 32 bytes). A connection is used only after a
// mutual challenge-response handshake over it; a peer that fails it is
// logged and closed, and nothing it sent is acted on:
//
//	dialer   -> listener  hello     {proto, node: A, nonce: Nc}
//	listener -> dialer    challenge {proto, node: B, nonce: Ns}
//	dialer   -> listener  proof     HMAC(secret, "client proof" | T)
//	listener -> dialer    welcome   HMAC(secret, "server proof" | T)
//
// where T binds the protocol version, both names and both 32-byte nonces,
// each length-prefixed. The listener checks the dialer's proof before it
// proves anything, so it is no oracle for strangers; the two proofs have
// different labels, so neither can be reflected as the other; fresh
// nonces on both sides make a recorded handshake useless. Either side
// sends {"type":"refused","reason":...} instead of its next message when
// it refuses, so that both logs say why. A peer named as this node is
// refused: a connection reflected back to its sender.
//
// Where to dial comes from the configuration or from DNS
// (Config.Service): an answer, forged or not, can make a node dial an
// address, and nothing more, since what answers there must pass the
// handshake.
//
// After the handshake, each direction has its own key,
// HMAC(HMAC(secret, "session" | T), direction), and every message is
//
//	length (4 bytes, big-endian) | seq (8) | HMAC-SHA256(key, seq | json) | json
//
// where seq counts the direction's messages from 0. A bad MAC or an
// unexpected seq (a changed, dropped, replayed or reflected message) ends
// the connection. Messages are not encrypted: segment names, sizes and
// owners are visible on the network.
//
// # Bounds
//
// A handshake message is at most 4 KiB and the handshake must end within
// Config.HandshakeTimeout (5 s); at most Config.MaxUnauthenticated
// accepted connections may be in their handshake at once. An
// authenticated message is at most MaxMessage (1 MiB). A connection
// serves at most 64 calls at once (more are answered CodeBusy). An idle
// connection is pinged every Config.KeepAlive; one silent for three
// intervals is closed, and a dialed peer is dialed again, with backoff.
// Of a service's answer, the first 1024 addresses are dialed.
//
// # Lifetimes
//
// Start's goroutines (the listener, one redialer per configured peer and
// per address of the service's last answer, the service's resolver, a
// reader and a pinger per connection, a goroutine per call served) all end
// when Close returns or Start's ctx is done; a handler's ctx ends when its
// caller gives up, its connection ends or the node closes. Each net.Conn
// is owned by the goroutine that accepted or dialed it, and closed by it.
package peer
