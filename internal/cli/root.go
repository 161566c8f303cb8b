package cli

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"syscall"

	"github.com/spf13/cobra"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/bench"
	"github.com/gpushm/gpushm/internal/complete"
	"github.com/gpushm/gpushm/internal/exitcode"
	"github.com/gpushm/gpushm/internal/pull"
)

// socketFlag is the global --socket; empty means gpushm.SocketCandidates
// for a client and gpushm.DefaultSocket for the daemon.
var socketFlag string

func run(args []string) error {
	root, plain := newRoot()
	output = exitcode.ScanFormat(args)
	root.SetArgs(args)
	cmd, err := root.ExecuteContextC(context.Background())
	if err == nil {
		return nil
	}
	if strings.HasPrefix(err.Error(), "unknown command ") {
		// cobra's own, for the root's first argument.
		return exitcode.Usagef(cmd, "%w", err)
	}
	for c := cmd; c != nil; c = c.Parent() {
		if plain[c] {
			return exitcode.NotClient(err)
		}
	}
	return err
}

// newRoot makes the command tree, and says which commands are not clients
// of the daemon (exitcode.NotClient).
func newRoot() (*cobra.Command, map[*cobra.Command]bool) {
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
socket, then /run/gpushm/gpushm.sock. 'gpushm info' says which one answered.

Commands that print take -o json, yaml, wide or name; with -o json or yaml
an error is one object on standard error too. docs/cli.md says more.

` + exitcode.Help,
		Example: `  gpushm daemon --detach           # serve host memory, or the GPUs, in the background
  gpushm put weights model.bin     # a file into a new segment
  gpushm ls -o wide
  gpushm get weights copy.bin
  gpushm rm weights
  source <(gpushm completion bash) # complete commands, flags and segment names`,
		Version:       cliVersion(),
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.SetVersionTemplate("gpushm {{.Version}}\n")
	// Before the completion commands are made: they take the writer then.
	root.SetOut(Stdout)
	root.SetErr(Stderr)
	// Defined here, cobra's would take -v, which put and get have for
	// --verbose.
	root.Flags().Bool("version", false, "print this client's version ('gpushm version' asks the daemon too)")
	root.PersistentFlags().StringVar(&socketFlag, "socket", "", "daemon socket path (default "+defaultSockets()+")")
	// Not a client of the daemon: their failures exit 1 (exitcode.NotClient).
	daemon, bench, demo, child, systemd := daemonCmd(), bench.Command(), bench.DemoCommand(), bench.ChildCommand(), installSystemdCmd()
	pullHelpers := pull.Command()
	root.AddCommand(
		daemon, infoCmd(), versionCmd(), createCmd(), lsCmd(), statCmd(), rmCmd(), dfCmd(),
		chmodCmd(), chownCmd(), mvCmd(), evictCmd(), syncCmd(), offerCmd(true), offerCmd(false), peersCmd(), pullCmd(), loadCmd(), pinCmd(true), pinCmd(false),
		putCmd(), getCmd(), catCmd(), bench, demo, child, pullHelpers, systemd, manCmd(),
	)
	// internal/bench's commands, given their examples here, where the
	// CLI's help is written.
	demo.Example = `  gpushm demo
  gpushm demo --backend host --size 1GiB`
	bench.Example = `  gpushm bench open --backend host
  gpushm bench files --sizes 1GiB,4GiB`
	root.SetFlagErrorFunc(func(cmd *cobra.Command, err error) error {
		if cmd.Name() == "chmod" && strings.Contains(err.Error(), "unknown shorthand flag") {
			// chmod -w NAME: a mode that reads as a flag.
			return exitcode.Usagef(cmd, "%v (a mode that starts with '-': 'gpushm chmod -- -w NAME')", err)
		}
		number := "a number here is positive"
		if cmd.Name() == "create" {
			number = "a size is positive, such as 4096, 64MiB or 1G"
		}
		return exitcode.FlagError(cmd, err, number)
	})
	walk(root, func(c *cobra.Command) {
		exitcode.StrictArgs(c)
		complete.Flags(dial, c)
	})
	bashCompletion(root)
	return root, map[*cobra.Command]bool{daemon: true, bench: true, demo: true, child: true, systemd: true}
}

// walk calls fn for cmd and every command below it.
func walk(cmd *cobra.Command, fn func(*cobra.Command)) {
	fn(cmd)
	for _, c := range cmd.Commands() {
		walk(c, fn)
	}
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
	c, err := gpushm.Dial(ctx, socketFlag)
	var we *gpushm.Error
	if err != nil && !errors.As(err, &we) {
		// No daemon answered; one that did and refused (too many
		// connections) said why, with an errno.
		return nil, exitcode.NoDaemon(err)
	}
	return c, err
}

// elsewhere says of err, a segment not found by the daemon c reached,
// which daemon answered, where that is the user's own and the node's
// listens too: the user's own daemon is tried first, and hides the
// node's (gpushm.SocketCandidates).
func elsewhere(c *gpushm.Client, err error) error {
	cands := gpushm.SocketCandidates()
	if !errors.Is(err, syscall.ENOENT) || socketFlag != "" || len(cands) < 2 {
		return err
	}
	node := cands[len(cands)-1]
	if c.Socket() == node {
		return err
	}
	if st, serr := os.Stat(node); serr != nil || st.Mode()&os.ModeSocket == 0 {
		return err
	}
	return exitcode.Errnof(syscall.ENOENT, "no such segment (your own daemon at %s answered; the node's listens at %s: 'gpushm --socket %s' asks it)",
		c.Socket(), node, node)
}

// eachName runs fn for every name on one connection, going on past
// failures, and returns them all, each said in verb's words (failed).
func eachName(ctx context.Context, verb string, names []string, fn func(c *gpushm.Client, name string) error) error {
	c, err := dial(ctx)
	if err != nil {
		return err
	}
	defer c.Close()
	var errs []error
	for _, name := range names {
		errs = append(errs, exitcode.Failed(verb, name, elsewhere(c, fn(c, name))))
	}
	return errors.Join(errs...)
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
