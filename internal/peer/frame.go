package peer

import (
	"bytes"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
)

// MaxMessage bounds an authenticated message, its sequence number and MAC
// included; a longer one ends the connection. A list of a node's segments
// with their chunks' CRCs fits many times over.
const MaxMessage = 1 << 20

// maxHandshake bounds a handshake message, read before the peer is known.
const maxHandshake = 4 << 10

// macSize is the size of an HMAC-SHA256.
const macSize = sha256.Size

// headerSize is what precedes an authenticated message's JSON: the
// sequence number and the MAC.
const headerSize = 8 + macSize

// errTooLong is a frame over its bound.
var errTooLong = errors.New("message too long")

// readFrame reads one frame: a 4-byte big-endian length, then that many
// bytes, refusing a length over max before reading any of it.
func readFrame(r io.Reader, max int) ([]byte, error) {
	var h [4]byte
	if _, err := io.ReadFull(r, h[:]); err != nil {
		return nil, err
	}
	n := binary.BigEndian.Uint32(h[:])
	if n > uint32(max) {
		return nil, fmt.Errorf("%w: %d bytes, at most %d", errTooLong, n, max)
	}
	b := make([]byte, n)
	if _, err := io.ReadFull(r, b); err != nil {
		return nil, fmt.Errorf("message of %d bytes: %w", n, noEOF(err))
	}
	return b, nil
}

// noEOF makes a frame cut short an unexpected EOF, never a clean one.
func noEOF(err error) error {
	if err == io.EOF {
		return io.ErrUnexpectedEOF
	}
	return err
}

// appendFrame appends body's frame to b.
func appendFrame(b, body []byte) []byte {
	b = binary.BigEndian.AppendUint32(b, uint32(len(body)))
	return append(b, body...)
}

// sealer signs the messages of one direction of a connection: each carries
// its sequence number and an HMAC of both under the direction's key.
type sealer struct {
	key []byte
	seq uint64
}

// seal frames msg as the next message of its direction.
func (s *sealer) seal(msg []byte) ([]byte, error) {
	if headerSize+len(msg) > MaxMessage {
		return nil, fmt.Errorf("%w: %d bytes, at most %d", errTooLong, headerSize+len(msg), MaxMessage)
	}
	body := make([]byte, 8, 4+headerSize+len(msg))
	binary.BigEndian.PutUint64(body, s.seq)
	body = append(body, mac(s.key, body[:8], msg)...)
	body = append(body, msg...)
	s.seq++
	return appendFrame(nil, body), nil
}

// open checks a frame's body as the next message of its direction and
// returns its JSON: a wrong MAC (a changed byte, another connection's
// message) or sequence number (a message dropped, replayed or reordered)
// is an error, and the connection ends.
func (s *sealer) open(body []byte) ([]byte, error) {
	if len(body) < headerSize {
		return nil, fmt.Errorf("message of %d bytes, shorter than its header", len(body))
	}
	seq, sum, msg := body[:8], body[8:headerSize], body[headerSize:]
	if !hmac.Equal(sum, mac(s.key, seq, msg)) {
		return nil, errors.New("message's MAC does not match: changed in flight, or not from this connection")
	}
	if n := binary.BigEndian.Uint64(seq); n != s.seq {
		return nil, fmt.Errorf("message %d where %d was due: dropped, replayed or reordered", n, s.seq)
	}
	s.seq++
	return msg, nil
}

func mac(key []byte, parts ...[]byte) []byte {
	h := hmac.New(sha256.New, key)
	for _, p := range parts {
		h.Write(p)
	}
	return h.Sum(nil)
}

// Message kinds after the handshake.
const (
	kindCall  = "call"
	kindReply = "reply"
	kindPing  = "ping"
	kindPong  = "pong"
)

// message is what authenticated frames carry: a call and its reply share
// an ID; pings and pongs keep an idle connection known to be alive.
type message struct {
	Kind string          `json:"kind"`
	ID   uint64          `json:"id,omitempty"`
	Op   string          `json:"op,omitempty"`
	MS   int64           `json:"ms,omitempty"` // the caller's time left, so the callee stops when it gives up
	Body json.RawMessage `json:"body,omitempty"`
	Err  *Error          `json:"err,omitempty"`
}

// maxOp bounds an operation's name.
const maxOp = 64

// decodeMessage decodes an authenticated message strictly: unknown fields,
// trailing data, an unknown kind or a call without an operation are
// errors, since only a peer holding the secret could have sent them.
func decodeMessage(b []byte) (*message, error) {
	var m message
	if err := strictJSON(b, &m); err != nil {
		return nil, fmt.Errorf("message: %w", err)
	}
	switch m.Kind {
	case kindCall:
		if m.Op == "" || len(m.Op) > maxOp || m.MS < 0 {
			return nil, fmt.Errorf("message: call %d with a bad operation or time (%.*q, %d ms)", m.ID, maxOp, m.Op, m.MS)
		}
	case kindReply, kindPing, kindPong:
	default:
		return nil, fmt.Errorf("message: unknown kind %.*q", maxOp, m.Kind)
	}
	return &m, nil
}

// strictJSON decodes one JSON value into v, refusing unknown fields and
// anything after the value.
func strictJSON(b []byte, v any) error {
	d := json.NewDecoder(bytes.NewReader(b))
	d.DisallowUnknownFields()
	if err := d.Decode(v); err != nil {
		return err
	}
	if _, err := d.Token(); err != io.EOF {
		return errors.New("data after the message")
	}
	return nil
}
