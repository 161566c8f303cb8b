package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"strings"
	"syscall"
	"time"

	"golang.org/x/term"
)

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

// watchList lists as ls does every interval, as watch(1) runs a command,
// until SIGINT (Ctrl-C), which ends it with status 0, as watch(1) users
// expect: it is how one stops watching, not a failure. SIGTERM ends it with
// 143. On a terminal each listing is drawn over the last, cut to the
// screen's height; elsewhere listings follow one another.
func watchList(ctx context.Context, args []string, sizes bool, every time.Duration) error {
	if err := checkPatterns(args); err != nil {
		return err
	}
	ctx, stop := interruptible(ctx)
	defer stop()
	c, err := dial(ctx)
	if err != nil {
		return err
	}
	defer c.Close()
	out := os.Stdout
	onTerminal := isTerminal(out)
	if onTerminal {
		io.WriteString(out, cursorHome+eraseScreen)
	}
	tick := time.NewTicker(every)
	defer tick.Stop()
	for n := 0; ctx.Err() == nil; n++ {
		var frame bytes.Buffer
		if output == "" || output == "wide" {
			what := strings.TrimSpace("gpushm ls " + strings.Join(args, " "))
			fmt.Fprintf(&frame, "Every %s: %s    %s\n\n", every, what, time.Now().Format(time.DateTime))
		}
		if err := listWith(ctx, c, &frame, args, sizes); err != nil {
			if ctx.Err() != nil {
				break // interrupted while listing: no frame to show
			}
			writeErrorText(&frame, failed("ls", "", err))
		}
		switch {
		case onTerminal:
			draw(out, frame.Bytes())
		case n > 0 && output == "yaml":
			io.WriteString(out, "---\n")
			out.Write(frame.Bytes())
		case n > 0 && output != "json":
			io.WriteString(out, "\n")
			fallthrough
		default:
			out.Write(frame.Bytes())
		}
		select {
		case <-ctx.Done():
		case <-tick.C:
		}
	}
	if interruption() == syscall.SIGINT {
		return nil
	}
	return ctx.Err()
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
