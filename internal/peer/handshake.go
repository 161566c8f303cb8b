package peer

import (
	"crypto/hmac"
	"crypto/rand"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"unicode"
)

// Version is the protocol version this package speaks; a peer speaking
// another is refused, naming both.
const Version = 1

// nonceSize is the size of each side's random challenge.
const nonceSize = 32

// maxNode bounds a node's name.
const maxNode = 255

// Labels keep each use of the secret apart, so that no MAC made for one
// can be taken for another: a server's proof is never a client's (no
// reflection), a key is never a proof.
const (
	labelClient = "gpushm peer v1 client proof"
	labelServer = "gpushm peer v1 server proof"
	labelKeys   = "gpushm peer v1 session"
	labelC2S    = "client to server"
	labelS2C    = "server to client"
)

// Handshake message types, in their order.
const (
	typeHello     = "hello"     // dialer: its name, version and nonce
	typeChallenge = "challenge" // listener: its name, version and nonce
	typeProof     = "proof"     // dialer: its proof over both
	typeWelcome   = "welcome"   // listener: its proof over both
	typeRefused   = "refused"   // either, instead of the next message: why
)

// hsMsg is a handshake message, sent before either side is known and so
// never trusted beyond its checks.
type hsMsg struct {
	Type   string `json:"type"`
	Proto  int    `json:"proto,omitempty"`
	Node   string `json:"node,omitempty"`
	Nonce  []byte `json:"nonce,omitempty"`
	Proof  []byte `json:"proof,omitempty"`
	Reason string `json:"reason,omitempty"`
}

// session is an authenticated connection's state: who the peer says it
// is (proved by its knowledge of the secret) and each direction's keys
// and sequence numbers.
type session struct {
	peer       string
	send, recv sealer
}

// RefusedError is a handshake that failed: the peer was not let in, or
// it did not let this node in. Node logs it with the peer's address.
type RefusedError struct {
	ByPeer bool   // the peer refused this node, saying Reason
	Reason string // what failed
}

func (e *RefusedError) Error() string {
	if e.ByPeer {
		return "refused by the peer: " + e.Reason
	}
	return "peer refused: " + e.Reason
}

func refuse(format string, args ...any) error {
	return &RefusedError{Reason: fmt.Sprintf(format, args...)}
}

// dialHandshake proves this node to the listener at the other end of c,
// and checks the listener's proof. nc is this side's nonce (newNonce).
// The caller sets c's deadline.
func dialHandshake(c net.Conn, secret []byte, node string, nc []byte) (*session, error) {
	if err := writeHS(c, hsMsg{Type: typeHello, Proto: Version, Node: node, Nonce: nc}); err != nil {
		return nil, err
	}
	ch, err := readHS(c, typeChallenge)
	if err != nil {
		return nil, err
	}
	if err := checkHello(ch, node); err != nil {
		return nil, sendRefusal(c, err)
	}
	t := transcript(node, ch.Node, nc, ch.Nonce)
	if err := writeHS(c, hsMsg{Type: typeProof, Proof: mac(secret, []byte(labelClient), t)}); err != nil {
		return nil, err
	}
	w, err := readHS(c, typeWelcome)
	if err != nil {
		return nil, err
	}
	if !hmac.Equal(w.Proof, mac(secret, []byte(labelServer), t)) {
		return nil, sendRefusal(c, refuse("node %q: its proof does not match our secret (the secrets differ, or it is not a gpushm peer)", ch.Node))
	}
	c2s, s2c := keys(secret, t)
	return &session{peer: ch.Node, send: sealer{key: c2s}, recv: sealer{key: s2c}}, nil
}

// acceptHandshake checks the proof of the dialer at the other end of c,
// then proves this node to it. The caller sets c's deadline.
func acceptHandshake(c net.Conn, secret []byte, node string) (*session, error) {
	h, err := readHS(c, typeHello)
	if err != nil {
		return nil, err
	}
	if err := checkHello(h, node); err != nil {
		return nil, sendRefusal(c, err)
	}
	ns := newNonce()
	if err := writeHS(c, hsMsg{Type: typeChallenge, Proto: Version, Node: node, Nonce: ns}); err != nil {
		return nil, err
	}
	p, err := readHS(c, typeProof)
	if err != nil {
		return nil, fmt.Errorf("node %q: %w", h.Node, err)
	}
	t := transcript(h.Node, node, h.Nonce, ns)
	if !hmac.Equal(p.Proof, mac(secret, []byte(labelClient), t)) {
		return nil, sendRefusal(c, refuse("node %q: its proof does not match our secret (the secrets differ, a replayed handshake, or not a gpushm peer)", h.Node))
	}
	if err := writeHS(c, hsMsg{Type: typeWelcome, Proof: mac(secret, []byte(labelServer), t)}); err != nil {
		return nil, err
	}
	c2s, s2c := keys(secret, t)
	return &session{peer: h.Node, send: sealer{key: s2c}, recv: sealer{key: c2s}}, nil
}

// newNonce returns a fresh random challenge.
func newNonce() []byte {
	b := make([]byte, nonceSize)
	rand.Read(b)
	return b
}

// checkHello checks the other side's hello or challenge.
func checkHello(m *hsMsg, node string) error {
	switch {
	case m.Proto != Version:
		return refuse("node %.*q speaks protocol version %d, this node %d", maxNode, m.Node, m.Proto, Version)
	case !validNode(m.Node):
		return refuse("bad node name %.*q", maxNode, m.Node)
	case m.Node == node:
		return refuse("node %q has this node's name: a connection reflected back to itself, or two nodes of one name", m.Node)
	case len(m.Nonce) != nonceSize:
		return refuse("node %q: nonce of %d bytes, want %d", m.Node, len(m.Nonce), nonceSize)
	}
	return nil
}

// validNode says whether s may name a node: printable, no spaces, short.
func validNode(s string) bool {
	if s == "" || len(s) > maxNode {
		return false
	}
	for _, r := range s {
		if !unicode.IsPrint(r) || unicode.IsSpace(r) {
			return false
		}
	}
	return true
}

// transcript binds a handshake: the protocol, both names and both nonces,
// each with its length, so that no two handshakes share one.
func transcript(client, server string, nc, ns []byte) []byte {
	var t []byte
	for _, f := range [][]byte{[]byte("gpushm peer"), []byte(strconv.Itoa(Version)), []byte(client), []byte(server), nc, ns} {
		t = binary.BigEndian.AppendUint32(t, uint32(len(f)))
		t = append(t, f...)
	}
	return t
}

// keys derives the connection's two keys, one a direction, so that a
// message can be neither replayed on another connection nor reflected
// back to its sender.
func keys(secret, t []byte) (c2s, s2c []byte) {
	prk := mac(secret, []byte(labelKeys), t)
	return mac(prk, []byte(labelC2S)), mac(prk, []byte(labelS2C))
}

func writeHS(c net.Conn, m hsMsg) error {
	b, err := json.Marshal(m)
	if err != nil {
		return err
	}
	if _, err := c.Write(appendFrame(nil, b)); err != nil {
		return fmt.Errorf("handshake: send %s: %w", m.Type, err)
	}
	return nil
}

// readHS reads the handshake message of type want, or the peer's refusal.
func readHS(c net.Conn, want string) (*hsMsg, error) {
	b, err := readFrame(c, maxHandshake)
	if errors.Is(err, io.EOF) && want != typeHello && want != typeChallenge {
		return nil, &RefusedError{ByPeer: true, Reason: "it closed the connection at the " + want + " (the secrets differ, or it refused this node)"}
	}
	if err != nil {
		return nil, fmt.Errorf("handshake: awaiting %s: %w", want, err)
	}
	m, err := decodeHS(b)
	if err != nil {
		return nil, refuse("%v", err)
	}
	switch m.Type {
	case want:
		return m, nil
	case typeRefused:
		return nil, &RefusedError{ByPeer: true, Reason: fmt.Sprintf("%.200s", m.Reason)}
	}
	return nil, refuse("handshake: %.*q where %s was due", maxOp, m.Type, want)
}

// decodeHS decodes a handshake message strictly.
func decodeHS(b []byte) (*hsMsg, error) {
	var m hsMsg
	if err := strictJSON(b, &m); err != nil {
		return nil, fmt.Errorf("handshake: %w", err)
	}
	return &m, nil
}

// sendRefusal tells the other side why it is refused, so that its log
// says so too, and returns err. The reason says nothing of the secret.
func sendRefusal(c net.Conn, err error) error {
	var r *RefusedError
	if errors.As(err, &r) {
		_ = writeHS(c, hsMsg{Type: typeRefused, Reason: r.Reason})
	}
	return err
}
