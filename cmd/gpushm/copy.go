package main

import (
	"context"
	"os"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/xfer"
)

// fillSteps has the daemon copy n bytes of f, from its start, into seg, in
// steps that bar follows and after which an interrupt stops the copy
// (xfer.Steps); the CRC-32C is the whole file's.
func fillSteps(ctx context.Context, seg *gpushm.Segment, f *os.File, n int64, bar *progress) (gpushm.CopyStats, error) {
	return xfer.Steps(n, bar.fn(), func(off, k int64) (gpushm.CopyStats, error) {
		return seg.Fill(ctx, f, off, off, k)
	})
}

// dumpSteps has the daemon copy seg's n bytes into f, in steps, as
// fillSteps does.
func dumpSteps(ctx context.Context, seg *gpushm.Segment, f *os.File, n int64, bar *progress) (gpushm.CopyStats, error) {
	return xfer.Steps(n, bar.fn(), func(off, k int64) (gpushm.CopyStats, error) {
		return seg.Dump(ctx, f, off, off, k)
	})
}
