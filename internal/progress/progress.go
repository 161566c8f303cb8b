// Package progress draws a copy's progress bar on standard error (bytes,
// rate, time left), when standard error is a terminal; otherwise nothing.
package progress

import (
	"fmt"
	"io"
	"os"
	"time"

	"github.com/vbauerster/mpb/v8"
	"github.com/vbauerster/mpb/v8/decor"
	"golang.org/x/term"

	"github.com/gpushm/gpushm/internal/terminal"
)

// Min is the smallest copy that gets a bar: smaller ones are over before
// a bar would be read.
const Min = 256 << 20

// fallbackWidth is the line's width on a terminal that reports none.
const fallbackWidth = 100

// Bar is a bar for a copy of a total of bytes. Its methods are safe for
// concurrent use, and a nil *Bar does nothing.
type Bar struct {
	p     *mpb.Progress
	bar   *mpb.Bar
	total int64
}

// New starts a bar, what followed by the counts, for a copy of total
// bytes; nil for a copy smaller than Min, or when standard error is not a
// terminal.
func New(what string, total int64) *Bar {
	if total < Min || !terminal.Is(os.Stderr) {
		return nil
	}
	// mpb renders, and so completes a bar, only while it refreshes; it
	// decides by itself whether the output is a terminal, so forcing the
	// refresh keeps Done from waiting for ever should the two checks
	// ever disagree (they once did, for /dev/null).
	// A terminal that says it has no columns (script(1), some CI
	// runners) would get an empty line each frame: mpb fits the bar to
	// the terminal's width. There the line is drawn for a terminal of
	// fallbackWidth columns, mpb told it writes to no terminal.
	var out io.Writer = os.Stderr
	width := 40
	if w, _, err := term.GetSize(int(os.Stderr.Fd())); err != nil || w <= 0 {
		out, width = struct{ io.Writer }{os.Stderr}, fallbackWidth
	}
	p := mpb.New(mpb.WithOutput(out), mpb.WithWidth(width), mpb.WithRefreshRate(150*time.Millisecond), mpb.WithAutoRefresh())
	start, final := time.Now(), ""
	rate := func(done int64) float64 { return float64(done) / max(time.Since(start).Seconds(), 1e-9) }
	bar := p.AddBar(total, mpb.BarWidth(40),
		mpb.PrependDecorators(
			decor.Name(what+" ", decor.WCSyncSpaceR),
			decor.CountersKibiByte("% .1f / % .1f", decor.WCSyncSpace),
		),
		// The rate and the time left are the whole copy's so far. mpb's
		// own keep, at completion, the rate of the last frame before it,
		// none for a copy the daemon made in a step or two; and its time
		// left counts whole nanoseconds a byte, 0 above 2 GB/s.
		mpb.AppendDecorators(
			decor.Any(func(s decor.Statistics) string {
				if final != "" {
					return final
				}
				msg := fmt.Sprintf("% .2f/s", decor.SizeB1000(int64(rate(s.Current))))
				if s.Completed {
					final = msg
				}
				return msg
			}, decor.WCSyncSpace),
			decor.OnComplete(decor.Any(func(s decor.Statistics) string {
				r := rate(s.Current)
				if r <= 0 {
					return "-"
				}
				left := time.Duration(float64(s.Total-s.Current) / r * float64(time.Second))
				return (left + time.Second - 1).Truncate(time.Second).String()
			}, decor.WCSyncSpace), " done"),
		),
	)
	return &Bar{p, bar, total}
}

// Add counts n more bytes done.
func (b *Bar) Add(n int64) {
	if b != nil {
		b.bar.IncrInt64(n)
	}
}

// Func is Add as a func value, or nil for no bar: a copy told of no
// progress may copy in fewer requests.
func (b *Bar) Func() func(int64) {
	if b == nil {
		return nil
	}
	return b.Add
}

// Done ends the bar: complete, or left where it stopped on failure.
func (b *Bar) Done(err error) {
	if b == nil {
		return
	}
	if err != nil {
		b.bar.Abort(false)
	} else {
		// Complete, though a total given up front may include bytes that
		// were written without a count, such as headers. (SetTotal would
		// not do: mpb ignores it for a bar made with a total, and Wait
		// then waited for ever.)
		b.bar.SetCurrent(b.total)
	}
	b.p.Wait()
}
