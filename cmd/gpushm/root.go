package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"

	"github.com/spf13/cobra"
	"golang.org/x/term"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/bench"
)

// socketFlag is the global --socket; empty means gpushm.SocketCandidates
// for a client and gpushm.DefaultSocket for the daemon.
var socketFlag string

func run(args []string) error {
	root := &cobra.Command{
		Use:   "gpushm",
		Short: "Named GPU memory segments shared between processes, zero-copy",
		Long: `gpushm is /dev/shm for GPUs. A daemon owns named GPU memory segments (CUDA
VMM allocations, or host memory on machines without a GPU) and hands them to
any process on the machine; every process maps the same physical memory.

Start the daemon with 'gpushm daemon', then create, list and remove segments
with the other commands. The socket is --socket if given, else
$GPUSHM_SOCKET if set. Otherwise the daemon listens on the user's own socket:
/run/gpushm/gpushm.sock for root (the node's daemon, which every user may
reach), $XDG_RUNTIME_DIR/gpushm/gpushm.sock for other users (or
/tmp/gpushm-UID/gpushm.sock); and the other commands try the user's own
socket, then /run/gpushm/gpushm.sock. 'gpushm info' says which one answered.`,
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.PersistentFlags().StringVar(&socketFlag, "socket", "", "daemon socket path (default "+defaultSockets()+")")
	root.AddCommand(
		daemonCmd(), infoCmd(), createCmd(), lsCmd(), statCmd(), rmCmd(),
		chmodCmd(), chownCmd(), mvCmd(), evictCmd(), loadCmd(), pinCmd(true), pinCmd(false),
		putCmd(), getCmd(), bench.Command(), bench.DemoCommand(), bench.ChildCommand(), installSystemdCmd(),
	)
	root.SetArgs(args)
	return root.ExecuteContext(context.Background())
}

// socketPath is where the daemon listens.
func socketPath() string {
	if socketFlag != "" {
		return socketFlag
	}
	return gpushm.DefaultSocket()
}

// defaultSockets says, for --help, where the daemon listens and where the
// other commands look when given no socket.
func defaultSockets() string {
	if p := os.Getenv("GPUSHM_SOCKET"); p != "" {
		return "$GPUSHM_SOCKET, now " + p
	}
	own := gpushm.DefaultSocket()
	if cands := gpushm.SocketCandidates(); len(cands) > 1 {
		return "$GPUSHM_SOCKET, else: the daemon listens on " + own + "; the other commands try it, then " + strings.Join(cands[1:], ", ")
	}
	return "$GPUSHM_SOCKET, else " + own
}

// dial connects to the daemon at --socket, else at the first of
// gpushm.SocketCandidates that answers.
func dial(ctx context.Context) (*gpushm.Client, error) {
	return gpushm.Dial(ctx, socketFlag)
}

// eachName runs fn for every name on one connection, going on past
// failures, and returns them all.
func eachName(ctx context.Context, names []string, fn func(c *gpushm.Client, name string) error) error {
	c, err := dial(ctx)
	if err != nil {
		return err
	}
	defer c.Close()
	var errs []error
	for _, name := range names {
		errs = append(errs, fn(c, name))
	}
	return errors.Join(errs...)
}

// isTerminal says whether f is a terminal. A character device is not enough:
// /dev/null is one, and a progress bar drawn there would only slow the copy.
func isTerminal(f *os.File) bool {
	return term.IsTerminal(int(f.Fd()))
}

// resolveDevice reads a --device value: "" for the daemon's default, an
// ordinal, or a GPU UUID (with or without "GPU-") that the daemon serves.
func resolveDevice(ctx context.Context, c *gpushm.Client, spec string) (*int, error) {
	if spec == "" {
		return nil, nil
	}
	if n, err := strconv.Atoi(spec); err == nil {
		return &n, nil
	}
	inf, err := c.Info(ctx)
	if err != nil {
		return nil, err
	}
	want := strings.TrimPrefix(strings.ToLower(spec), "gpu-")
	for _, d := range inf.Devices {
		if d.UUID != "" && strings.TrimPrefix(strings.ToLower(d.UUID), "gpu-") == want {
			return &d.Index, nil
		}
	}
	return nil, fmt.Errorf("--device %q: no GPU of the daemon's has that UUID ('gpushm info' lists them)", spec)
}
