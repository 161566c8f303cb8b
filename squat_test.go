package gpushm_test

import (
	"bufio"
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/backend"
	"github.com/gpushm/gpushm/internal/server"
	"github.com/gpushm/gpushm/internal/testdaemon"
	"github.com/gpushm/gpushm/internal/testutil"
)

// The victim and the attacker of the tests below: two users of one node.
const victimUID, attackerUID = 4242, 4243

// attacker is an ordinary daemon run by attackerUID (a child of this test
// binary), listening where a victim might look for its own.
type attacker struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	out   *bufio.Reader
}

// startAttacker runs a daemon as attackerUID on socket until the test ends
// (or stop). Its directory must exist or be one the attacker may make.
func startAttacker(t *testing.T, bin, socket string) *attacker {
	t.Helper()
	cmd := exec.Command(bin, "-test.run=^$")
	cmd.Env = append(os.Environ(), "GPUSHM_TEST_CHILD=attacker", "SOCKET="+socket)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: attackerUID, Gid: attackerUID}}
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	a := &attacker{cmd: cmd, stdin: stdin, out: bufio.NewReader(stdout)}
	t.Cleanup(func() { a.stdin.Close(); a.cmd.Wait() })
	if line, _ := a.out.ReadString('\n'); line != "serving\n" {
		a.stdin.Close()
		t.Fatalf("the attacker's daemon on %s did not start (%q): %v", socket, line, cmd.Wait())
	}
	return a
}

// stop ends the attacker's daemon and says what it received: the requests
// it was sent and the segments it holds, each "" if none.
func (a *attacker) stop(t *testing.T) (requests, segments string) {
	t.Helper()
	a.stdin.Close()
	rest, _ := io.ReadAll(a.out)
	if err := a.cmd.Wait(); err != nil {
		t.Fatalf("the attacker's daemon: %v", err)
	}
	for _, line := range strings.Split(string(rest), "\n") {
		if v, ok := strings.CutPrefix(line, "requests:"); ok {
			requests = strings.TrimSpace(v)
		}
		if v, ok := strings.CutPrefix(line, "segments:"); ok {
			segments = strings.TrimSpace(v)
		}
	}
	return requests, segments
}

// attackerChild is the attacker's side: a daemon on $SOCKET, which prints
// "serving", then, once its stdin closes, every request it was sent and the
// names it holds.
func attackerChild() error {
	var mu sync.Mutex
	var seen []string
	d, stop, err := testdaemon.RunAt("host", os.Getenv("SOCKET"), func(srv *server.Server, _ backend.Backend) {
		srv.SetObserver(observer(func(op string) {
			mu.Lock()
			seen = append(seen, op)
			mu.Unlock()
		}))
	})
	if err != nil {
		return err
	}
	fmt.Println("serving")
	io.Copy(io.Discard, os.Stdin)
	var names []string
	for _, inf := range d.Server.Registry().List("", 0) {
		names = append(names, inf.Name)
	}
	if err := stop(); err != nil {
		return err
	}
	mu.Lock()
	defer mu.Unlock()
	fmt.Println("requests:", strings.Join(seen, " "))
	fmt.Println("segments:", strings.Join(names, " "))
	return nil
}

// observer records the op of every request a server is sent.
type observer func(op string)

func (o observer) Observe(op, _ string, _ time.Duration) { o(op) }
func (observer) Connected(int)                           {}

// dialChild is a victim's side: it dials as a program given no socket does
// ($GPUSHM_SOCKET, else the candidates, with the node's socket at
// $GPUSHM_TEST_SYSTEM_SOCKET if set) and puts a segment ($NAME, else
// "victims") where it got to.
// It prints "reached PATH", or "untrusted=BOOL: ERROR" when it reached none.
func dialChild() error {
	if s := os.Getenv("GPUSHM_TEST_SYSTEM_SOCKET"); s != "" {
		defer gpushm.FakeSockets(os.Geteuid(), s)()
	}
	ctx := context.Background()
	c, err := gpushm.Dial(ctx, "")
	if err != nil {
		fmt.Printf("untrusted=%t: %v\n", errors.Is(err, gpushm.ErrUntrusted), err)
		return nil
	}
	defer c.Close()
	name := cmp.Or(os.Getenv("NAME"), "victims")
	if _, _, err := c.CreateOnly(ctx, name, 4096, nil); err != nil {
		return err
	}
	fmt.Println("reached", c.Socket())
	return nil
}

// asVictim runs dialChild as victimUID with env (and no $GPUSHM_SOCKET,
// $XDG_RUNTIME_DIR or $TMPDIR but what env sets), and returns its line.
func asVictim(t *testing.T, bin string, env ...string) string {
	t.Helper()
	cmd := exec.Command(bin, "-test.run=^$")
	for _, kv := range os.Environ() {
		switch strings.SplitN(kv, "=", 2)[0] {
		case "GPUSHM_SOCKET", "XDG_RUNTIME_DIR", "TMPDIR":
		default:
			cmd.Env = append(cmd.Env, kv)
		}
	}
	cmd.Env = append(cmd.Env, "GPUSHM_TEST_CHILD=dial", "GPUSHM_TIMEOUT=5s", "GPUSHM_RECONNECT=0")
	cmd.Env = append(cmd.Env, env...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: victimUID, Gid: victimUID}}
	cmd.Stderr = os.Stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("victim: %v\n%s", err, out)
	}
	return strings.TrimSpace(string(out))
}

// mkdirAs makes dir, of mode (chmod'ed, past the umask), owned by uid.
func mkdirAs(t *testing.T, dir string, mode os.FileMode, uid int) {
	t.Helper()
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(dir, uid, uid); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dir, mode); err != nil {
		t.Fatal(err)
	}
}

// TestSquattedSocket: a user with no $GPUSHM_SOCKET nor $XDG_RUNTIME_DIR
// looks for its own socket in $TMPDIR/gpushm-UID, a path any other user
// may take first. Another user who does, and runs an ordinary daemon
// there, or leaves a socket of its daemon where the victim looks, gets
// nothing: the victim skips the path, saying why, and reaches the node's
// daemon; it sends the attacker's daemon nothing, not even hello.
func TestSquattedSocket(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("playing two users needs root")
	}
	node := testdaemon.Start(t, "host")
	bin := testutil.BinaryForOthers(t)
	// The victim's $TMPDIR, which anyone may write, as /tmp.
	tmp, err := os.MkdirTemp("", "gpushm-squat-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(tmp) })
	os.Chmod(tmp, 0o777|os.ModeSticky)
	own := filepath.Join(tmp, fmt.Sprintf("gpushm-%d", victimUID))
	victimEnv := []string{"TMPDIR=" + tmp, "GPUSHM_TEST_SYSTEM_SOCKET=" + node.Socket}
	// A directory of the attacker's that the victim may enter.
	lair := filepath.Join(tmp, "lair")
	mkdirAs(t, lair, 0o755, attackerUID)
	const hint = " (is 'gpushm daemon' running? set $GPUSHM_SOCKET to choose a socket)"

	tests := []struct {
		name string
		// squat starts the attacker's daemon and puts what it can where
		// the victim looks.
		squat func(t *testing.T) *attacker
		why   string // the victim's reason for skipping own
	}{
		{"another user made the directory", func(t *testing.T) *attacker {
			mkdirAs(t, own, 0o755, attackerUID)
			return startAttacker(t, bin, filepath.Join(own, "gpushm.sock"))
		}, own + ": owned by uid 4243, not you: skipped (another user may have made it)"},
		{"the victim's directory, open to all", func(t *testing.T) *attacker {
			mkdirAs(t, own, 0o777, victimUID)
			a := startAttacker(t, bin, filepath.Join(lair, "gpushm.sock"))
			// What the attacker may do in a directory open to all.
			if err := os.Rename(filepath.Join(lair, "gpushm.sock"), filepath.Join(own, "gpushm.sock")); err != nil {
				t.Fatal(err)
			}
			return a
		}, own + ": mode 0777 lets group or others replace the socket: skipped (chmod go-w " + own + ")"},
		{"a symbolic link", func(t *testing.T) *attacker {
			a := startAttacker(t, bin, filepath.Join(lair, "gpushm.sock"))
			if err := os.Symlink(lair, own); err != nil {
				t.Fatal(err)
			}
			os.Lchown(own, attackerUID, attackerUID)
			return a
		}, own + ": a symbolic link, not a directory: skipped (another user may have made it)"},
		{"the attacker's socket in the victim's directory", func(t *testing.T) *attacker {
			mkdirAs(t, own, 0o700, victimUID)
			a := startAttacker(t, bin, filepath.Join(lair, "gpushm.sock"))
			// As if the victim had been tricked into moving it there.
			if err := os.Rename(filepath.Join(lair, "gpushm.sock"), filepath.Join(own, "gpushm.sock")); err != nil {
				t.Fatal(err)
			}
			return a
		}, filepath.Join(own, "gpushm.sock") + ": owned by uid 4243, neither you nor root: skipped (another user may have put it there)"},
	}
	for i, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Cleanup(func() { os.RemoveAll(own); os.Remove(filepath.Join(lair, "gpushm.sock")) })
			a := tc.squat(t)
			name := fmt.Sprintf("victims-%d", i)
			if got, want := asVictim(t, bin, append(victimEnv, "NAME="+name)...), "reached "+node.Socket; got != want {
				t.Errorf("victim: %s\nwant %s", got, want)
			}
			if _, err := node.Server.Registry().Stat(name); err != nil {
				t.Errorf("the node's daemon: %v", err)
			}

			// With no node's daemon to fall back on, the error says why
			// the victim's own path was skipped.
			nowhere := filepath.Join(filepath.Dir(node.Socket), "nowhere.sock")
			got := asVictim(t, bin, "TMPDIR="+tmp, "GPUSHM_TEST_SYSTEM_SOCKET="+nowhere)
			want := "untrusted=true: gpushm: cannot reach a daemon: " + tc.why + "; " + nowhere + ": no such file" + hint
			if got != want {
				t.Errorf("victim with no node's daemon: %s\nwant %s", got, want)
			}
			if requests, segments := a.stop(t); requests != "" || segments != "" {
				t.Errorf("the attacker's daemon was sent %q and holds %q, want nothing", requests, segments)
			}
		})
	}
}

// TestDaemonOfAnotherUser: a daemon that answers as another user is
// refused before it is sent anything, even on a path given explicitly,
// unless $GPUSHM_DAEMON_UID names its user (a node's daemon run as a
// dedicated user): then on the node's socket too, in a directory of that
// user's.
func TestDaemonOfAnotherUser(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("playing two users needs root")
	}
	bin := testutil.BinaryForOthers(t)
	dir, err := os.MkdirTemp("", "gpushm-other-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	os.Chmod(dir, 0o755)
	lair := filepath.Join(dir, "lair")
	mkdirAs(t, lair, 0o755, attackerUID)
	sock := filepath.Join(lair, "gpushm.sock")
	a := startAttacker(t, bin, sock)

	refused := sock + ": the daemon answering runs as uid 4243, neither you (uid %d) nor root: refused, nothing sent" +
		" (another user may run it; set GPUSHM_DAEMON_UID=4243 if that user runs the node's daemon)"
	got := asVictim(t, bin, "GPUSHM_SOCKET="+sock)
	if want := "untrusted=true: gpushm: cannot reach a daemon: " + fmt.Sprintf(refused, victimUID) +
		" (is 'gpushm daemon' running? the path is $GPUSHM_SOCKET)"; got != want {
		t.Errorf("victim with $GPUSHM_SOCKET at another user's daemon: %s\nwant %s", got, want)
	}
	// Root, given the path.
	_, err = gpushm.Dial(context.Background(), sock)
	if want := "gpushm: " + fmt.Sprintf(refused, 0); err == nil || err.Error() != want || !errors.Is(err, gpushm.ErrUntrusted) {
		t.Errorf("Dial(%s) as root = %v\nwant %s, matching ErrUntrusted", sock, err, want)
	}
	// The node's socket, in the other user's directory.
	got = asVictim(t, bin, "GPUSHM_TEST_SYSTEM_SOCKET="+sock, "TMPDIR="+dir)
	if want := "untrusted=true: gpushm: cannot reach a daemon: " + filepath.Join(dir, "gpushm-4242", "gpushm.sock") + ": no such file; " +
		lair + ": owned by uid 4243, neither root nor you: skipped (another user may have made it; set GPUSHM_DAEMON_UID=4243 if that user runs the node's daemon)" +
		" (is 'gpushm daemon' running? set $GPUSHM_SOCKET to choose a socket)"; got != want {
		t.Errorf("victim with the node's socket in another user's directory: %s\nwant %s", got, want)
	}
	if requests, segments := a.stop(t); requests != "" || segments != "" {
		t.Fatalf("the other user's daemon was sent %q and holds %q, want nothing", requests, segments)
	}

	// The same daemon, as the node's, run by a dedicated user.
	a = startAttacker(t, bin, sock)
	if got := asVictim(t, bin, "GPUSHM_SOCKET="+sock, "GPUSHM_DAEMON_UID=4243"); got != "reached "+sock {
		t.Errorf("victim with GPUSHM_DAEMON_UID: %s, want it reached %s", got, sock)
	}
	got = asVictim(t, bin, "GPUSHM_TEST_SYSTEM_SOCKET="+sock, "TMPDIR="+dir, "GPUSHM_DAEMON_UID=4243", "NAME=found")
	if got != "reached "+sock {
		t.Errorf("victim with GPUSHM_DAEMON_UID, finding the node's socket: %s, want it reached %s", got, sock)
	}
	if requests, segments := a.stop(t); segments != "found victims" {
		t.Errorf("the dedicated user's daemon was sent %q and holds %q, want the victim's segment", requests, segments)
	}
	if got := asVictim(t, bin, "GPUSHM_SOCKET="+sock, "GPUSHM_DAEMON_UID=daemon"); !strings.Contains(got, `GPUSHM_DAEMON_UID="daemon" is not a uid`) {
		t.Errorf("victim with a GPUSHM_DAEMON_UID that is not a number: %s", got)
	}
}

// TestReconnectChecksTheDaemon: a client checks who answers on every
// connection, not only the first: when its daemon went away and another
// user's daemon took the path (a directory open to all, sticky as /tmp),
// the client's next call fails, saying so, and sends that daemon nothing.
func TestReconnectChecksTheDaemon(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("playing two users needs root")
	}
	bin := testutil.BinaryForOthers(t)
	dir, err := os.MkdirTemp("", "gpushm-reconnect-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	os.Chmod(dir, 0o777|os.ModeSticky)
	sock := filepath.Join(dir, "gpushm.sock")
	d := testdaemon.StartAt(t, "host", sock)
	ctx := context.Background()
	c := dial(t, sock)
	if _, _, err := c.CreateOnly(ctx, "before", 4096, nil); err != nil {
		t.Fatal(err)
	}
	d.Stop()
	a := startAttacker(t, bin, sock)
	_, _, err = c.CreateOnly(ctx, "after", 4096, nil)
	if !errors.Is(err, gpushm.ErrUntrusted) || !strings.Contains(err.Error(), "the daemon answering runs as uid 4243, neither you (uid 0) nor root: refused, nothing sent") {
		t.Errorf("a call after another user's daemon took the path: %v, want it refused, matching ErrUntrusted", err)
	}
	if _, _, err := c.CreateOnly(ctx, "later", 4096, nil); !errors.Is(err, gpushm.ErrUntrusted) {
		t.Errorf("the next call: %v, want the client to stay refused", err)
	}
	if requests, segments := a.stop(t); requests != "" || segments != "" {
		t.Errorf("the other user's daemon was sent %q and holds %q, want nothing", requests, segments)
	}
}
