package terminal

import (
	"bytes"
	"errors"
	"testing"
)

// TestTextOnly: what is text on a terminal: UTF-8 without NUL, a character
// split between two writes included.
func TestTextOnly(t *testing.T) {
	text := []byte("h\u00e9llo \u4e16\u754c \U0001F600\n")
	for i := range len(text) + 1 {
		var out bytes.Buffer
		w := TextOnly(&out)
		_, err1 := w.Write(text[:i])
		_, err2 := w.Write(text[i:])
		if err1 != nil || err2 != nil || !bytes.Equal(out.Bytes(), text) {
			t.Errorf("text written as %q and %q: %v, %v, %q", text[:i], text[i:], err1, err2, out.Bytes())
		}
	}
	for _, b := range [][]byte{{'a', 0, 'b'}, {0xe9, 't', 0xe9}, {0xff, 0xfe}, []byte("\xe4\xb8 broken")} {
		var out bytes.Buffer
		if _, err := TextOnly(&out).Write(b); !errors.Is(err, ErrBinary) || out.Len() != 0 {
			t.Errorf("Write(%q) = %v, wrote %q; want ErrBinary and nothing written", b, err, out.Bytes())
		}
	}
	// A character begun at one write's end and not finished by the next.
	var out bytes.Buffer
	w := TextOnly(&out)
	if _, err := w.Write([]byte("ok \xe4")); err != nil {
		t.Fatal(err)
	}
	if _, err := w.Write([]byte("x")); !errors.Is(err, ErrBinary) {
		t.Errorf("a character cut short by the next write: %v, want ErrBinary", err)
	}
}
