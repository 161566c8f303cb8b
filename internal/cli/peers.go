package cli

import (
	"context"
	"fmt"
	"os"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/complete"
	"github.com/gpushm/gpushm/internal/exitcode"
	"github.com/gpushm/gpushm/internal/progress"
	"github.com/gpushm/gpushm/internal/terminal"
)

const peersHelp = `A daemon started with --listen-peers, --peers or --peer-service (and
--peer-secret) keeps authenticated connections to the daemons of other
nodes, which tell each other the segments their owners offer
(docs/peers.md). Nothing is offered unless its owner says so.`

func offerCmd(on bool) *cobra.Command {
	use, short, long, example := "offer NAME...", "Offer segments to the daemon's peers on other nodes",
		peersHelp+"\n\n'gpushm offer' lists a segment to the peers until 'gpushm unoffer'. The owner\nor root may.",
		"  gpushm offer llama"
	if !on {
		use, short, long, example = "unoffer NAME...", "Stop offering segments to the daemon's peers",
			peersHelp+"\n\n'gpushm unoffer' undoes 'gpushm offer' (or 'create --offer'). The owner or\nroot may.",
			"  gpushm unoffer llama"
	}
	verb, _, _ := strings.Cut(use, " ")
	return &cobra.Command{
		Use: use, Short: short, Long: long, Example: example,
		Args:              cobra.MinimumNArgs(1),
		ValidArgsFunction: complete.Names(dial),
		RunE: func(cmd *cobra.Command, args []string) error {
			return eachName(cmd.Context(), verb, args, func(c *gpushm.Client, name string) error {
				s, err := c.Offer(cmd.Context(), name, on)
				if err != nil {
					return err
				}
				state := "offered to peers"
				if !s.Offer {
					state = "not offered"
				}
				fmt.Fprintf(Stdout, "%s: %s\n", s.Name, state)
				return nil
			})
		},
	}
}

func peersCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "peers",
		Short: "List the daemon's peers on other nodes and what each offers",
		Long: peersHelp + `

'gpushm peers' prints each peer (the addresses this daemon dials, and the
daemons that dialed it): whether it is connected, since when, the last
error if not, and the segments it offers. -o json prints the report.`,
		Example: "  gpushm peers\n  gpushm peers -o json",
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx, cancel := context.WithTimeout(cmd.Context(), 30*time.Second)
			defer cancel()
			c, err := dial(ctx)
			if err != nil {
				return err
			}
			defer c.Close()
			r, err := c.Peers(ctx)
			if err != nil {
				return exitcode.Failed("peers", "", err)
			}
			if structured() {
				return printValue(r)
			}
			if r == nil {
				fmt.Fprintln(Stdout, "no peers: the daemon was started without --listen-peers, --peers or --peer-service")
				return nil
			}
			listen := r.Listen
			if listen == "" {
				listen = "-"
			}
			fmt.Fprintf(Stdout, "node %s, listening for peers on %s\n", r.Node, listen)
			if r.Service != "" {
				fmt.Fprintf(Stdout, "peers: every address of %s", r.Service)
				if r.ServiceError != "" {
					fmt.Fprintf(Stdout, ", not resolved: %s", r.ServiceError)
				}
				fmt.Fprintln(Stdout)
			}
			w := tabwriter.NewWriter(Stdout, 0, 4, 2, ' ', 0)
			fmt.Fprintln(w, "PEER\tADDRESS\tSTATE\tOFFERS")
			for _, p := range r.Peers {
				name, state := p.Name, "connected"
				if name == "" {
					name = "-"
				}
				if !p.Connected {
					state = "not connected"
					if p.LastError != "" {
						state += ": " + p.LastError
					}
				}
				var offers []string
				for _, o := range p.Offers {
					offers = append(offers, o.Name)
				}
				what := strings.Join(offers, ",")
				switch {
				case p.Error != "":
					what = "? (" + p.Error + ")"
				case what == "" && p.Connected:
					what = "(none)"
				case what == "":
					what = "-"
				}
				fmt.Fprintf(w, "%s\t%s\t%s\t%s\n", name, p.Addr, state, what)
			}
			return w.Flush()
		},
	}
	addOutput(cmd, true)
	return cmd
}

func pullCmd() *cobra.Command {
	var from string
	cmd := &cobra.Command{
		Use:   "pull NAME",
		Short: "Copy a segment a peer on another node offers into this node's memory",
		Long: peersHelp + `

'gpushm pull NAME' has the daemon copy NAME from a peer that offers it
(--from PEER, or any connected peer that lists it) into a new segment of
the same name here: the owner where that user name exists here, with its
mode, else root's and 0600. The bytes move over UCX between helper
processes that hold only the segment, each chunk checked against the
lender's CRC-32C; the segment is committed only when every chunk checked,
and a failure leaves nothing behind and tries the next peer that offers
it. Root, or the user the segment will belong to, may pull. GPU memory
is staged through pinned buffers at each end. While other nodes pull the
same name, the peer may send this one along a chain: to the last node it
lent the name to, which lends each chunk on as it arrives. On a terminal,
a bar shows the bytes checked so far.`,
		Example: "  gpushm pull llama\n  gpushm pull llama --from node2",
		Args:    cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := dial(cmd.Context())
			if err != nil {
				return err
			}
			defer c.Close()
			start := time.Now()
			stop := pullBar(cmd.Context(), args[0])
			s, err := c.Pull(cmd.Context(), args[0], from)
			stop(err)
			if err != nil {
				return exitcode.Failed("pull", args[0], err)
			}
			d := time.Since(start)
			fmt.Fprintf(Stdout, "pulled %s: %d bytes in %.3fs (%.2f GB/s)\n", s.Name, s.Size, d.Seconds(), float64(s.Size)/d.Seconds()/1e9)
			return nil
		},
	}
	cmd.Flags().StringVar(&from, "from", "", "the peer to pull from (a node name or HOST:PORT; default: any that offers it)")
	return cmd
}

// pullBar draws the pull of name on a terminal, asking the daemon on a
// connection of its own how far it got; the function returned ends it.
func pullBar(ctx context.Context, name string) func(error) {
	if !terminal.Is(os.Stderr) {
		return func(error) {}
	}
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan *progress.Bar)
	go func() {
		var bar *progress.Bar
		defer func() { done <- bar }()
		c, err := dial(ctx)
		if err != nil {
			return
		}
		defer c.Close()
		var last int64
		for t := time.NewTicker(200 * time.Millisecond); ; {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
			p, err := c.PullProgress(ctx, name)
			if err != nil || p == nil {
				continue
			}
			if bar == nil {
				if bar = progress.New("pull "+name, p.Size); bar == nil {
					return // too small for a bar
				}
			}
			bar.Add(p.Done - last)
			last = p.Done
		}
	}()
	return func(err error) {
		cancel()
		if bar := <-done; bar != nil {
			bar.Done(err)
		}
	}
}
