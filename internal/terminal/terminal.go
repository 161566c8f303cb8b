// Package terminal is what the commands do differently on a terminal:
// refuse binary output that would mess it up (cat), and draw each frame
// of a repeated listing over the last (ls --watch).
package terminal

import (
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"strings"
	"time"
	"unicode/utf8"

	"golang.org/x/term"
)

// Is says whether f is a terminal. A character device is not enough:
// /dev/null is one, and what is drawn for a person there would only slow
// the command.
func Is(f *os.File) bool {
	return term.IsTerminal(int(f.Fd()))
}

// ErrBinary is output that would mess up a terminal.
var ErrBinary = errors.New("binary output can mess up your terminal")

// TextOnly returns a writer to w, a terminal, of what is text, which
// refuses the rest with ErrBinary before writing any of it. Text is UTF-8
// without NUL: curl's test is a NUL byte alone, which a piece of random
// bytes lacks more often than not, while it is never valid UTF-8 for
// long. A character split between two writes is checked whole.
func TextOnly(w io.Writer) io.Writer { return &textOnly{w: w} }

type textOnly struct {
	w       io.Writer
	partial []byte // the start of a character the last write ended in
}

func (t *textOnly) Write(b []byte) (int, error) {
	body := b
	if n := len(t.partial); n > 0 {
		c := append(t.partial, b[:min(len(b), utf8.UTFMax-n)]...)
		if !utf8.FullRune(c) {
			t.partial = c
			return t.w.Write(b)
		}
		r, size := utf8.DecodeRune(c)
		if r == utf8.RuneError && size == 1 {
			return 0, ErrBinary
		}
		body, t.partial = b[size-n:], t.partial[:0]
	}
	tail := 0 // bytes of a character that the next write ends
	for k := 1; k <= min(utf8.UTFMax-1, len(body)); k++ {
		if utf8.RuneStart(body[len(body)-k]) {
			if !utf8.FullRune(body[len(body)-k:]) {
				tail = k
			}
			break
		}
	}
	if bytes.IndexByte(body, 0) >= 0 || !utf8.Valid(body[:len(body)-tail]) {
		return 0, ErrBinary
	}
	t.partial = append(t.partial, body[len(body)-tail:]...)
	return t.w.Write(b)
}

// Escape sequences of the terminals people use (ECMA-48): the cursor to
// the top left, erase to the end of the line, erase to the end of the
// screen. A frame drawn over the last one, line by line, does not flash as
// one drawn on a cleared screen does.
const (
	cursorHome  = "\x1b[H"
	eraseLine   = "\x1b[K"
	eraseScreen = "\x1b[2J"
	eraseBelow  = "\x1b[J"
)

// Repeat writes to out what frame writes, every interval, as watch(1)
// runs a command, until ctx is done or frame returns false (for a frame
// not to show). On a terminal each frame is drawn over the last, cut to
// the screen's height; elsewhere frames follow one another, sep between
// them.
func Repeat(ctx context.Context, out io.Writer, every time.Duration, sep string, frame func(w io.Writer) bool) {
	f, onTerminal := out.(*os.File)
	onTerminal = onTerminal && Is(f)
	if onTerminal {
		io.WriteString(out, cursorHome+eraseScreen)
	}
	tick := time.NewTicker(every)
	defer tick.Stop()
	for n := 0; ctx.Err() == nil; n++ {
		var b bytes.Buffer
		if !frame(&b) {
			break
		}
		if onTerminal {
			draw(f, b.Bytes())
		} else {
			if n > 0 && sep != "" {
				io.WriteString(out, sep)
			}
			out.Write(b.Bytes())
		}
		select {
		case <-ctx.Done():
		case <-tick.C:
		}
	}
}

// draw writes frame over the one on the terminal, each line erased to its
// end, and no more lines than the screen has.
func draw(out *os.File, frame []byte) {
	lines := strings.Split(strings.TrimSuffix(string(frame), "\n"), "\n")
	if _, rows, err := term.GetSize(int(out.Fd())); err == nil && rows > 1 && len(lines) > rows-1 {
		lines = lines[:rows-1]
	}
	var b strings.Builder
	b.WriteString(cursorHome)
	for _, l := range lines {
		b.WriteString(l)
		b.WriteString(eraseLine + "\n")
	}
	b.WriteString(eraseBelow)
	io.WriteString(out, b.String())
}
