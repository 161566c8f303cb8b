package main

import (
	"fmt"
	"io"
	"os"
	"time"

	"github.com/vbauerster/mpb/v8"
	"github.com/vbauerster/mpb/v8/decor"
)

// minProgress is the smallest copy that gets a progress bar: smaller ones
// are over before a bar would be read.
const minProgress = 256 << 20

// progress is a bar on standard error (bytes, rate, time left) for a copy
// of total bytes, when standard error is a terminal; otherwise nothing. Its
// methods are safe for concurrent use, and a nil *progress does nothing.
type progress struct {
	p     *mpb.Progress
	bar   *mpb.Bar
	total int64
}

func newProgress(what string, total int64) *progress {
	if total < minProgress || !isTerminal(os.Stderr) {
		return nil
	}
	// mpb renders, and so completes a bar, only while it refreshes; it
	// decides by itself whether the output is a terminal, so forcing the
	// refresh keeps finish from waiting for ever should the two checks
	// ever disagree (they once did, for /dev/null).
	p := mpb.New(mpb.WithOutput(os.Stderr), mpb.WithWidth(40), mpb.WithRefreshRate(150*time.Millisecond), mpb.WithAutoRefresh())
	start, final := time.Now(), ""
	rate := func(done int64) float64 { return float64(done) / max(time.Since(start).Seconds(), 1e-9) }
	bar := p.AddBar(total,
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
	return &progress{p, bar, total}
}

// add counts n more bytes done.
func (p *progress) add(n int64) {
	if p != nil {
		p.bar.IncrInt64(n)
	}
}

// fn is add as a func value, or nil for no progress.
func (p *progress) fn() func(int64) {
	if p == nil {
		return nil
	}
	return p.add
}

// finish ends the bar: complete, or left where it stopped on failure.
func (p *progress) finish(err error) {
	if p == nil {
		return
	}
	if err != nil {
		p.bar.Abort(false)
	} else {
		// Complete, though a total given up front may include bytes that
		// were written without a count, such as headers. (SetTotal would
		// not do: mpb ignores it for a bar made with a total, and Wait
		// then waited for ever.)
		p.bar.SetCurrent(p.total)
	}
	p.p.Wait()
}

// writer counts what passes through w.
func (p *progress) writer(w io.Writer) io.Writer {
	if p == nil {
		return w
	}
	return progressWriter{w, p}
}

type progressWriter struct {
	w io.Writer
	p *progress
}

func (pw progressWriter) Write(b []byte) (int, error) {
	n, err := pw.w.Write(b)
	pw.p.add(int64(n))
	return n, err
}
