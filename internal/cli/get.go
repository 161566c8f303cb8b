package cli

import (
	"context"
	"errors"
	"fmt"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/gpushm/gpushm/checkpoint"
	"github.com/gpushm/gpushm/internal/complete"
	"github.com/gpushm/gpushm/internal/exitcode"
	"github.com/gpushm/gpushm/internal/interrupt"
	"github.com/gpushm/gpushm/internal/report"
	"github.com/gpushm/gpushm/internal/terminal"
)

func getCmd() *cobra.Command {
	var (
		copyOpts copyFlags
		verbose  bool
		o        checkpoint.GetFileOptions
	)
	cmd := &cobra.Command{
		Use:   "get NAME FILE|DIR",
		Short: "Copy a segment into a file, or a checkpoint bundle back into its directory ('-' writes stdout)",
		Long: `Copy segment NAME (its size, not the rounded allocation) into FILE. The
segment is opened read-only. The daemon copies, with its warm copy engine,
unless --copier client (or a tuning flag) has this process copy, with
several copiers in parallel, each through a pinned buffer and its own CUDA
stream. A bar shows the bytes copied, the rate and the time left on a
terminal.

FILE is written under a temporary name beside it and renamed over FILE only
once complete, so that a get that fails or is interrupted (Ctrl-C: exit
130) leaves FILE as it was, or no FILE. A FILE that exists keeps its
permission bits; FIFOs and devices (/dev/null) are written in place.

A bundle made by 'gpushm put NAME DIR' is written back as that directory:
its shard files byte for byte, and its small files. DIR must not exist or
must be empty; if anything fails, or get is interrupted, what was written
is removed. --raw writes the segment's bytes to one file instead, as '-'
does.

A segment still being written ('gpushm put' in progress, listed as
incomplete) is refused; --wait waits that long for it to be complete, or
for the name to appear.

FILE '-' is standard output, but not a terminal, where the bytes could
mess it up: 'gpushm cat NAME' shows a segment that is text.

It prints nothing on standard output unless -o asks: -o json and -o yaml
print what was copied, -o name the segment's name.`,
		Example: `  gpushm get weights model.bin
  gpushm get llama ./llama-restored        # a bundle put from a directory
  gpushm get weights - | sha256sum
  gpushm get --wait 5m weights model.bin   # while 'gpushm put' still writes it`,
		Args:              cobra.ExactArgs(2),
		ValidArgsFunction: complete.NamesThenFiles(dial, func(*cobra.Command) bool { return true }),
		RunE: func(cmd *cobra.Command, args []string) error {
			name, path := args[0], args[1]
			if path == "-" && isTerminal(Stdout) {
				// As cat refuses binary there: a segment's bytes can
				// mess up a terminal, and are seldom what one wants to see.
				return fmt.Errorf("get %s: %w: 'gpushm get %s FILE' writes a file, 'gpushm get %s - | CMD' a pipe, 'gpushm cat %s' shows text",
					name, terminal.ErrBinary, name, name, name)
			}
			if o.Wait < 0 {
				return exitcode.Usagef(cmd, "--wait %s: want a positive duration", o.Wait)
			}
			co, err := copyOpts.options()
			if err != nil {
				return exitcode.Usagef(cmd, "%v", err)
			}
			if o.InDaemon, err = copyOpts.inDaemon(); err != nil {
				return exitcode.Usagef(cmd, "%v", err)
			}
			ctx, stop := interrupt.Context(cmd.Context())
			defer stop()
			o.Copy = *co
			res, err := get(ctx, name, path, verbose, &o)
			err = exitcode.Failed("get", name, err)
			if errors.Is(err, syscall.EAGAIN) {
				err = fmt.Errorf("%w ('gpushm get --wait 1m %s %s' waits for it)", err, name, path)
			}
			if err != nil {
				return err
			}
			return printCopy(res)
		},
	}
	cmd.Flags().BoolVar(&o.Raw, "raw", false, "write a checkpoint bundle's bytes as one file, not as its directory")
	cmd.Flags().BoolVarP(&verbose, "verbose", "v", false, "print how the copy went")
	addQuiet(cmd)
	cmd.Flags().DurationVar(&o.Wait, "wait", 0, "wait this long (e.g. 30s, 5m; at most 1h) for a segment being written, or not there yet")
	copyOpts.register(cmd)
	addOutput(cmd, false)
	return cmd
}

// get writes segment name into path (checkpoint.GetFile), and says how
// fast on a terminal, or with verbose.
func get(ctx context.Context, name, path string, verbose bool, o *checkpoint.GetFileOptions) (res report.Copy, err error) {
	c, err := dial(ctx)
	if err != nil {
		return res, err
	}
	defer c.Close()
	start := time.Now()
	o.Progress, o.AtExit = progressFor("get "+name), interrupt.AtExit
	cp, err := checkpoint.GetFile(ctx, c, name, path, o)
	if err != nil {
		return res, err
	}
	res = report.Copy{Name: name, File: cp.File, Bytes: cp.Bytes, Copier: cp.Copier}
	res.Finish(start)
	if cp.Bytes > 0 { // an empty segment's file is made, not copied
		rate("get", name, cp.Bytes, time.Since(start), cp.Stats, verbose)
	}
	return res, nil
}
