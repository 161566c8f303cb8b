package peer

import (
	"errors"
	"fmt"
)

// Error codes carried by a failed call. A handler chooses its own codes
// for its operations; these are the ones the package itself gives.
const (
	// CodeUnknownOp: the peer serves no such operation (an older version,
	// or no handler).
	CodeUnknownOp = "unknown_op"
	// CodeBadRequest: the request did not decode as the operation's.
	CodeBadRequest = "bad_request"
	// CodeNotFound: no such name on the peer.
	CodeNotFound = "not_found"
	// CodeDenied: the peer will not do it for this node.
	CodeDenied = "denied"
	// CodeBusy: the peer serves too many calls of this connection at once.
	CodeBusy = "busy"
	// CodeFailed: the handler returned an error that was not an *Error.
	CodeFailed = "failed"
)

// Error is a call's failure as the peer reported it: a code callers test,
// and a message for people. Peer and Op are filled in by Call.
type Error struct {
	Peer    string `json:"-"`
	Op      string `json:"-"`
	Code    string `json:"code"`
	Message string `json:"message"`
}

// Errorf makes an Error for a handler to return.
func Errorf(code, format string, args ...any) *Error {
	return &Error{Code: code, Message: fmt.Sprintf(format, args...)}
}

func (e *Error) Error() string {
	if e.Peer == "" {
		return fmt.Sprintf("%s (%s)", e.Message, e.Code)
	}
	return fmt.Sprintf("peer %s: %s: %s (%s)", e.Peer, e.Op, e.Message, e.Code)
}

// Is matches an Error of the same code, so that
// errors.Is(err, &peer.Error{Code: peer.CodeNotFound}) tests the code.
func (e *Error) Is(target error) bool {
	t, ok := target.(*Error)
	return ok && t.Code == e.Code && (t.Message == "" || t.Message == e.Message)
}

// ErrNotConnected is wrapped by Call's error when no authenticated
// connection to the peer is up.
var ErrNotConnected = errors.New("not connected")

// ErrTimeout is wrapped by Call's error when the peer did not answer in
// time: a partition, a dead node, or a handler that took too long.
var ErrTimeout = errors.New("no answer")

// ErrClosed is wrapped by Call's error when the connection ended before
// the answer came, or the Node was closed.
var ErrClosed = errors.New("connection closed")

// toError turns a handler's error into what goes on the wire.
func toError(err error) *Error {
	var e *Error
	if errors.As(err, &e) {
		return &Error{Code: e.Code, Message: e.Message}
	}
	return &Error{Code: CodeFailed, Message: err.Error()}
}
