package cli

import (
	"github.com/spf13/cobra"

	"github.com/gpushm/gpushm/internal/exitcode"
	"github.com/gpushm/gpushm/internal/report"
)

func infoCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "info",
		Short: "Show the daemon's backend, devices and processes",
		Long: `Show the daemon's backend, devices and processes. It exits 0 only when a
daemon answers, so it doubles as a health check.

-o json (or --json) and -o yaml print one document with the protocol's
field names (docs/protocol.md, "info"), including "pid", the process serving the socket
(the one a crash would take down), and "supervisor_pid", the one holding
every segment across restarts of the serving process.`,
		Example: `  gpushm info
  gpushm info -o json | jq .usage
  until gpushm info >/dev/null 2>&1; do sleep 1; done   # wait for the daemon`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			return exitcode.Failed("info", "", info(cmd))
		},
	}
	addOutput(cmd, true, "json", "yaml", "wide")
	return cmd
}

func info(cmd *cobra.Command) error {
	c, err := dial(cmd.Context())
	if err != nil {
		return err
	}
	defer c.Close()
	inf, err := c.Info(cmd.Context())
	if err != nil {
		return err
	}
	if structured() {
		return printValue(inf)
	}
	return report.Info(Stdout, inf, c.Socket())
}
