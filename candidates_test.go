package gpushm_test

import (
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"slices"
	"syscall"
	"testing"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/testdaemon"
)

func TestSocketCandidates(t *testing.T) {
	const system = "/run/gpushm/gpushm.sock"
	tests := []struct {
		name     string
		euid     int
		env      map[string]string
		want     []string
		listenOn string // DefaultSocket
	}{
		{"the variable alone", 1234, map[string]string{"GPUSHM_SOCKET": "/x/y.sock", "XDG_RUNTIME_DIR": "/run/user/1234"},
			[]string{"/x/y.sock"}, "/x/y.sock"},
		{"root: the system socket, once", 0, map[string]string{"XDG_RUNTIME_DIR": "/run/user/0"},
			[]string{system}, system},
		{"a user: its own, then the system's", 1234, map[string]string{"XDG_RUNTIME_DIR": "/run/user/1234"},
			[]string{"/run/user/1234/gpushm/gpushm.sock", system}, "/run/user/1234/gpushm/gpushm.sock"},
		{"a user without XDG_RUNTIME_DIR", 1234, map[string]string{"TMPDIR": "/scratch"},
			[]string{"/scratch/gpushm-1234/gpushm.sock", system}, "/scratch/gpushm-1234/gpushm.sock"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			defer gpushm.FakeSockets(tc.euid, system)()
			for _, k := range []string{"GPUSHM_SOCKET", "XDG_RUNTIME_DIR", "TMPDIR"} {
				t.Setenv(k, tc.env[k])
			}
			if got := gpushm.SocketCandidates(); !slices.Equal(got, tc.want) {
				t.Errorf("SocketCandidates() = %q, want %q", got, tc.want)
			}
			if got := gpushm.DefaultSocket(); got != tc.listenOn {
				t.Errorf("DefaultSocket() = %q, want %q", got, tc.listenOn)
			}
		})
	}
}

// TestDialFindsTheNodesDaemon: a user with no daemon of its own reaches the
// node's; when none answers, the error names every path tried; a client
// that reached the node's daemon goes back to it after a restart even when
// the user's own daemon has come up since.
func TestDialFindsTheNodesDaemon(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	system := filepath.Join(dir, "run", "gpushm.sock")
	own := filepath.Join(dir, "xdg", "gpushm", "gpushm.sock")
	// A user's, whose own directory (made by the daemon below, as root)
	// is then given to it: a client uses the user's own socket only in a
	// directory of the user's.
	user := os.Geteuid()
	if user == 0 {
		user = 1234
	}
	defer gpushm.FakeSockets(user, system)()
	t.Setenv("GPUSHM_SOCKET", "")
	t.Setenv("XDG_RUNTIME_DIR", filepath.Join(dir, "xdg"))

	_, err := gpushm.Dial(ctx, "")
	want := "gpushm: cannot reach a daemon: " + own + ": no such file; " + system +
		": no such file (is 'gpushm daemon' running? set $GPUSHM_SOCKET to choose a socket)"
	if err == nil || err.Error() != want {
		t.Fatalf("Dial with no daemon: %v\nwant %s", err, want)
	}
	// A socket nobody serves any more: refused, and tried past.
	os.MkdirAll(filepath.Dir(system), 0o755)
	ln, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: system, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	ln.SetUnlinkOnClose(false)
	ln.Close()
	_, err = gpushm.Dial(ctx, "")
	want = "gpushm: cannot reach a daemon: " + own + ": no such file; " + system +
		": connection refused (is 'gpushm daemon' running? set $GPUSHM_SOCKET to choose a socket)"
	if err == nil || err.Error() != want || !errors.Is(err, syscall.ECONNREFUSED) {
		t.Fatalf("Dial with a stale socket: %v\nwant %s, matching ECONNREFUSED", err, want)
	}

	node := testdaemon.StartAt(t, "host", system)
	c, err := gpushm.Dial(ctx, "")
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if c.Socket() != system {
		t.Fatalf("Socket() = %s, want the node's %s", c.Socket(), system)
	}
	if _, _, err := c.CreateOnly(ctx, "before", 4096, nil); err != nil {
		t.Fatal(err)
	}

	// The user's own daemon comes up, and the node's restarts.
	mine := testdaemon.StartAt(t, "host", own)
	if err := os.Chown(filepath.Dir(own), user, user); err != nil {
		t.Fatal(err)
	}
	node.Stop()
	restarted := testdaemon.StartAt(t, "host", system)
	if _, _, err := c.CreateOnly(ctx, "after", 4096, nil); err != nil {
		t.Fatal(err)
	}
	if c.Socket() != system || c.Reconnects() != 1 {
		t.Fatalf("after the restart: Socket() = %s, %d reconnection(s); want %s, 1", c.Socket(), c.Reconnects(), system)
	}
	if _, err := restarted.Server.Registry().Stat("after"); err != nil {
		t.Fatalf("the restarted node's daemon: %v", err)
	}
	if _, err := mine.Server.Registry().Stat("after"); err == nil {
		t.Fatal("the client moved to the user's own daemon on reconnecting")
	}
	// The variable chooses one, and the error says so.
	t.Setenv("GPUSHM_SOCKET", filepath.Join(dir, "nowhere.sock"))
	_, err = gpushm.Dial(ctx, "")
	want = "gpushm: cannot reach a daemon: " + filepath.Join(dir, "nowhere.sock") +
		": no such file (is 'gpushm daemon' running? the path is $GPUSHM_SOCKET)"
	if err == nil || err.Error() != want {
		t.Fatalf("Dial with $GPUSHM_SOCKET: %v\nwant %s", err, want)
	}
	t.Setenv("GPUSHM_SOCKET", "")

	// A new client finds the user's own first.
	c2, err := gpushm.Dial(ctx, "")
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	if c2.Socket() != own {
		t.Fatalf("with both up, Socket() = %s, want the user's own %s", c2.Socket(), own)
	}
}
