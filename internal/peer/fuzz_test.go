package peer

import (
	"bytes"
	"encoding/json"
	"testing"
)

var fuzzKey = bytes.Repeat([]byte{7}, macSize)

// FuzzDecode feeds bytes from the network to every decoder: frames,
// handshake messages, sealed messages. None may panic; a sealed message
// that opens and decodes encodes back to one that does the same.
func FuzzDecode(f *testing.F) {
	seal := func(m message) []byte {
		b, _ := json.Marshal(m)
		s := sealer{key: fuzzKey}
		fr, _ := s.seal(b)
		return fr
	}
	hs := func(m hsMsg) []byte {
		b, _ := json.Marshal(m)
		return appendFrame(nil, b)
	}
	for _, seed := range [][]byte{
		seal(message{Kind: kindCall, ID: 1, Op: "list", MS: 100, Body: []byte(`{}`)}),
		seal(message{Kind: kindReply, ID: 1, Err: &Error{Code: CodeNotFound, Message: "no"}}),
		seal(message{Kind: kindPing}),
		seal(message{Kind: "nonsense"}),
		hs(hsMsg{Type: typeHello, Proto: Version, Node: "a", Nonce: newNonce()}),
		hs(hsMsg{Type: typeRefused, Reason: "why"}),
		{0, 0, 0, 2, '{', '}'},
		{0xff, 0xff, 0xff, 0xff},
		{},
	} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		r := bytes.NewReader(data)
		body, err := readFrame(r, MaxMessage)
		if err != nil {
			return
		}
		decodeHS(body)
		decodeMessage(body) // as a peer holding the secret could send it
		s := sealer{key: fuzzKey}
		b, err := s.open(body)
		if err != nil {
			return
		}
		m, err := decodeMessage(b)
		if err != nil {
			return
		}
		again, err := json.Marshal(m)
		if err != nil {
			t.Fatalf("Marshal(%+v) = %v", m, err)
		}
		if _, err := decodeMessage(again); err != nil {
			t.Fatalf("decodeMessage(%s) = %v, it decoded as %+v", again, err, m)
		}
	})
}
