// Package wire is gpushm's wire protocol: the message types, their encoding,
// and the transport that carries them over a SOCK_SEQPACKET Unix socket with
// file descriptors attached through SCM_RIGHTS.
//
// Every message is one JSON object in one packet of at most MaxMessage bytes.
// A packet carries at most one file descriptor. docs/protocol.md is the
// normative description; this package is its Go rendering.
//
// Operations (ops.go) is the one list of the protocol's operations: the
// decoder reads each one's fields from it, the server dispatches by it,
// and tests hold docs/protocol.md's op row and sections, and the
// conformance examples, to it.
//
// Ownership: a descriptor passed to Conn.Send stays owned by the caller (the
// kernel duplicates it into the peer). A descriptor returned by Conn.Recv is
// owned by the caller, who must close it on every path.
package wire
