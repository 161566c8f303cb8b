package cli

import (
	"context"
	"errors"
	"fmt"
	"io"

	"github.com/spf13/cobra"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/checkpoint"
	"github.com/gpushm/gpushm/internal/complete"
	"github.com/gpushm/gpushm/internal/terminal"
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
		ValidArgsFunction: complete.Names(dial),
		RunE: func(cmd *cobra.Command, args []string) error {
			out := io.Writer(Stdout)
			if !force && isTerminal(Stdout) {
				out = terminal.TextOnly(Stdout)
			}
			// No signal handling: Ctrl-C ends cat as it ends cat(1), and
			// the daemon lets go of what the connection held.
			return eachName(cmd.Context(), "cat", args, func(c *gpushm.Client, name string) error {
				err := cat(cmd.Context(), c, name, out)
				if errors.Is(err, terminal.ErrBinary) {
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
	seg, err := checkpoint.OpenRead(ctx, c, name, 0)
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
