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
	bar := p.AddBar(total,
		mpb.PrependDecorators(
			decor.Name(what+" ", decor.WCSyncSpaceR),
			decor.CountersKibiByte("% .1f / % .1f", decor.WCSyncSpace),
		),
		mpb.AppendDecorators(
			// mpb's AverageSpeed keeps the rate of the last frame before
			// completion, which for a copy the daemon makes in a few
			// steps may be none: this one is the whole copy's at the end.
			decor.Any(func(s decor.Statistics) string {
				if final != "" {
					return final
				}
				rate := float64(s.Current) / max(time.Since(start).Seconds(), 1e-9)
				msg := fmt.Sprintf("% .2f/s", decor.SizeB1000(int64(rate)))
				if s.Completed {
					final = msg
				}
				return msg
			}, decor.WCSyncSpace),
			decor.OnComplete(decor.AverageETA(decor.ET_STYLE_GO, decor.WCSyncSpace), " done"),
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
