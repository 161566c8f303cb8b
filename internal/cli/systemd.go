package cli

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"github.com/spf13/cobra"

	"github.com/gpushm/gpushm/internal/daemon"
)

func installSystemdCmd() *cobra.Command {
	var (
		unitDir string
		print   bool
		enable  bool
	)
	cmd := &cobra.Command{
		Use:   "install-systemd [-- DAEMON FLAGS...]",
		Short: "Install a systemd unit that runs the daemon, restarts it without loss, and upgrades it on reload",
		Long: `Write gpushm.service (the file in deploy/systemd, with this binary's path) to
--unit-dir and reload systemd. Flags after -- go to 'gpushm daemon', e.g.

    gpushm install-systemd --enable -- --mount /mnt/gpushm --metrics-listen 127.0.0.1:9464

Then: 'systemctl reload gpushm' upgrades to the binary on disk, 'systemctl
restart gpushm' keeps every segment, 'systemctl stop gpushm' frees them.`,
		Example: `  sudo gpushm install-systemd --enable
  gpushm install-systemd --print -- --gpu-budget 80%`,
		RunE: func(cmd *cobra.Command, args []string) error {
			exe, err := os.Executable()
			if err != nil {
				return err
			}
			if exe, err = filepath.EvalSymlinks(exe); err != nil {
				return err
			}
			unit := daemon.SystemdUnit(exe, args)
			if print {
				fmt.Fprint(Stdout, unit)
				return nil
			}
			path := filepath.Join(unitDir, "gpushm.service")
			if err := os.WriteFile(path, []byte(unit), 0o644); err != nil {
				if os.Geteuid() != 0 && errors.Is(err, fs.ErrPermission) {
					return fmt.Errorf("write the unit: %w (run it as root: 'sudo gpushm install-systemd')", err)
				}
				return fmt.Errorf("write the unit: %w", err)
			}
			fmt.Fprintf(Stdout, "wrote %s\n", path)
			systemctl, err := exec.LookPath("systemctl")
			if _, serr := os.Stat("/run/systemd/system"); err != nil || serr != nil {
				// sd_booted(3): systemd is not the init system here.
				fmt.Fprintln(Stdout, "systemd does not run here: on the machine that runs it, 'systemctl daemon-reload && systemctl enable --now gpushm'")
				return nil
			}
			steps := [][]string{{"daemon-reload"}}
			if enable {
				steps = append(steps, []string{"enable", "--now", "gpushm"})
			}
			for _, s := range steps {
				if out, err := exec.Command(systemctl, s...).CombinedOutput(); err != nil {
					return fmt.Errorf("systemctl %s: %v: %s", strings.Join(s, " "), err, strings.TrimSpace(string(out)))
				}
			}
			if !enable {
				fmt.Fprintln(Stdout, "start it with: systemctl enable --now gpushm")
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&unitDir, "unit-dir", "/etc/systemd/system", "where to write gpushm.service")
	f.BoolVar(&print, "print", false, "print the unit instead of installing it")
	f.BoolVar(&enable, "enable", false, "also enable and start the service")
	return cmd
}
