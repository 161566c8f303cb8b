package cli

import (
	"os"
	"path/filepath"
	"testing"
)

// TestDetachedLogIgnoresRootsEnvironment: as root, whose environment may
// be a user's (sudo -E), the default log is /var/log/gpushm's, never under
// $XDG_STATE_HOME or $HOME, where that user could have put a link.
func TestDetachedLogIgnoresRootsEnvironment(t *testing.T) {
	attacker := t.TempDir()
	t.Setenv("XDG_STATE_HOME", attacker)
	t.Setenv("HOME", attacker)
	got := defaultDaemonLog()
	if os.Geteuid() == 0 {
		if got != "/var/log/gpushm/daemon.log" {
			t.Fatalf("root's default log: %s, want /var/log/gpushm/daemon.log", got)
		}
		return
	}
	if got != filepath.Join(attacker, "gpushm", "daemon.log") {
		t.Fatalf("a user's default log: %s, want under its $XDG_STATE_HOME", got)
	}
}
