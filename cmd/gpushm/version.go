package main

import (
	"context"
	"fmt"
	"runtime"
	"runtime/debug"
	"time"

	"github.com/spf13/cobra"

	"github.com/gpushm/gpushm"
)

// version is this binary's version: the VERSION file at the module's root
// (gpushm.Version), which the Python wheel and the container image take
// theirs from too.
var version = gpushm.Version()

// cliVersion is what --version prints after "gpushm ".
func cliVersion() string { return version }

// versionInfo is what 'gpushm version' says, as -o json prints it.
type versionInfo struct {
	Client clientVersion `json:"client"`
	// Daemon is nil when none answered; DaemonError says why.
	Daemon      *daemonVersion `json:"daemon"`
	DaemonError string         `json:"daemon_error,omitempty"`
}

type clientVersion struct {
	Version  string `json:"version"`
	Go       string `json:"go"`
	Platform string `json:"platform"`
	// Commit is the revision built, when the build recorded it (go build
	// in a git checkout, without -buildvcs=false); Modified, that the
	// tree had changes.
	Commit   string `json:"commit,omitempty"`
	Modified bool   `json:"modified,omitempty"`
}

type daemonVersion struct {
	Version string `json:"version"`
	Backend string `json:"backend"`
	Socket  string `json:"socket"`
	PID     int    `json:"pid"`
}

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
			v := versionInfo{Client: clientVersion{Version: version, Go: runtime.Version(), Platform: runtime.GOOS + "/" + runtime.GOARCH}}
			if bi, ok := debug.ReadBuildInfo(); ok {
				for _, s := range bi.Settings {
					switch s.Key {
					case "vcs.revision":
						v.Client.Commit = s.Value
					case "vcs.modified":
						v.Client.Modified = s.Value == "true"
					}
				}
			}
			// A daemon that does not answer soon is reported, not waited for.
			ctx, cancel := context.WithTimeout(cmd.Context(), 5*time.Second)
			defer cancel()
			if c, err := dial(ctx); err != nil {
				v.DaemonError = message(err)
			} else {
				defer c.Close()
				if inf, err := c.Info(ctx); err != nil {
					v.DaemonError = message(err)
				} else {
					v.Daemon = &daemonVersion{Version: inf.Server, Backend: inf.Backend, Socket: c.Socket(), PID: inf.PID}
				}
			}
			if structured() {
				return printValue(v)
			}
			commit := ""
			if v.Client.Commit != "" {
				commit = ", commit " + v.Client.Commit
				if v.Client.Modified {
					commit += " (modified)"
				}
			}
			fmt.Printf("client:  gpushm %s (%s, %s%s)\n", v.Client.Version, v.Client.Go, v.Client.Platform, commit)
			if d := v.Daemon; d != nil {
				fmt.Printf("daemon:  gpushm %s, backend %s, pid %d, at %s\n", d.Version, d.Backend, d.PID, d.Socket)
			} else {
				fmt.Printf("daemon:  none answered: %s\n", v.DaemonError)
			}
			return nil
		},
	}
	addOutput(cmd, false, "json", "yaml", "wide")
	return cmd
}
