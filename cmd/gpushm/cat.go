package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"syscall"
	"time"
	"unicode/utf8"

	"github.com/spf13/cobra"

	"github.com/gpushm/gpushm"
)

func catCmd() *cobra.Command {
	var force bool
	cmd := &cobra.Command{
		Use:   "cat NAME...",
		Short: "Write segments' bytes to standard output",
		Long: `Write each segment's bytes (its size, not the rounded allocation) to
standard output, one after another, as cat(1) does with files. Each is
opened read-only and streamed a piece at a time: a segment larger than
this machine's free memory is written all the same.

Binary output can mess up a terminal: on a terminal, a piece that is not
text (UTF-8 without NUL bytes) stops the command before it is written,
unless --force says to write it anyway, as curl does. A pipe or a file gets the bytes as they
are. 'gpushm get NAME FILE' writes a segment into a file, with the
daemon's copy engine.

A segment still being written ('gpushm put' in progress) is refused; an
empty one writes nothing.`,
		Example: `  gpushm cat config | jq .
  gpushm cat weights | sha256sum
  gpushm cat part1 part2 > whole.bin`,
		Args:              cobra.MinimumNArgs(1),
		ValidArgsFunction: segmentNames(),
		RunE: func(cmd *cobra.Command, args []string) error {
			out := io.Writer(os.Stdout)
			if !force && isTerminal(os.Stdout) {
				out = &textOnly{w: os.Stdout}
			}
			// No signal handling: Ctrl-C ends cat as it ends cat(1), and
			// the daemon lets go of what the connection held.
			return eachName(cmd.Context(), "cat", args, func(c *gpushm.Client, name string) error {
				err := cat(cmd.Context(), c, name, out)
				if errors.Is(err, errBinary) {
					err = fmt.Errorf("%w: 'gpushm cat --force %s' writes it here anyway, 'gpushm get %s FILE' into a file", err, name, name)
				}
				return err
			})
		},
	}
	cmd.Flags().BoolVarP(&force, "force", "f", false, "write binary output to a terminal too")
	return cmd
}

// catPiece is how much of a segment cat writes at a time: a terminal
// check and a write's worth, small next to any memory.
const catPiece = 1 << 20

// cat writes segment name's bytes to w, a piece at a time.
func cat(ctx context.Context, c *gpushm.Client, name string, w io.Writer) error {
	seg, err := openForRead(ctx, c, name, 0)
	if err != nil || seg == nil {
		return err // or empty: nothing to write
	}
	defer seg.Close()
	m, err := seg.Map()
	if err != nil {
		return err
	}
	_, err = m.WriteTo(pieces{w})
	return err
}

// openForRead opens name read-only, waiting up to wait for it to be
// committed; a nil segment and no error is an empty segment, which holds
// no memory to open (docs/protocol.md, "create": empty).
func openForRead(ctx context.Context, c *gpushm.Client, name string, wait time.Duration) (*gpushm.Segment, error) {
	seg, err := c.Open(ctx, name, &gpushm.OpenOptions{ReadOnly: true, Wait: wait})
	if err == nil || !errors.Is(err, syscall.EINVAL) {
		return seg, err
	}
	// The open path stays one round trip: only a refused open asks
	// whether the segment is empty.
	if s, serr := c.Stat(ctx, name); serr == nil && s.Size == 0 && !s.Uncommitted && s.Orphan == "" {
		return nil, nil
	}
	return nil, err
}

// pieces writes to w catPiece bytes at a time, whatever one Write is
// given: a mapping of host memory is written in one.
type pieces struct{ w io.Writer }

func (p pieces) Write(b []byte) (int, error) {
	var n int
	for len(b) > 0 {
		k, err := p.w.Write(b[:min(len(b), catPiece)])
		n += k
		if err != nil {
			return n, err
		}
		b = b[k:]
	}
	return n, nil
}

// errBinary is output that would mess up a terminal.
var errBinary = errors.New("binary output can mess up your terminal")

// textOnly writes to a terminal what is text, and refuses the rest before
// writing any of it. Text is UTF-8 without NUL: curl's test is a NUL byte
// alone, which a piece of random bytes lacks more often than not, while
// it is never valid UTF-8 for long. A character split between two
// writes is checked whole.
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
			return 0, errBinary
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
		return 0, errBinary
	}
	t.partial = append(t.partial, body[len(body)-tail:]...)
	return t.w.Write(b)
}
