package cli

import (
	"context"
	"time"

	"github.com/spf13/cobra"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/exitcode"
	"github.com/gpushm/gpushm/internal/report"
)

// version is this binary's version: the VERSION file at the module's root
// (gpushm.Version), which the Python wheel and the container image take
// theirs from too.
var version = gpushm.Version()

// cliVersion is what --version prints after "gpushm ".
func cliVersion() string { return version }

func versionCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "version",
		Short: "Show this client's version, and the daemon's when one answers",
		Long: `Show this client's version, the Go release it was built with and, when a
daemon answers on the socket, the daemon's version, backend and socket.
One version string, from the VERSION file of the source, names the binary,
the Python wheel and the container image. 'gpushm --version' prints the
client's alone.

It exits 0 whether or not a daemon answers: 'gpushm info' is the health
check.`,
		Example: `  gpushm version
  gpushm version -o json | jq -r .daemon.version`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			v := report.Version{Client: report.Client(version)}
			// A daemon that does not answer soon is reported, not waited for.
			ctx, cancel := context.WithTimeout(cmd.Context(), 5*time.Second)
			defer cancel()
			if c, err := dial(ctx); err != nil {
				v.DaemonError = exitcode.Message(err)
			} else {
				defer c.Close()
				if inf, err := c.Info(ctx); err != nil {
					v.DaemonError = exitcode.Message(err)
				} else {
					v.Daemon = &report.DaemonVersion{Version: inf.Server, Backend: inf.Backend, Socket: c.Socket(), PID: inf.PID}
				}
			}
			if structured() {
				return printValue(v)
			}
			v.Write(Stdout)
			return nil
		},
	}
	addOutput(cmd, false, "json", "yaml", "wide")
	return cmd
}
