package integration

import (
	"bufio"
	"bytes"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gpushm/gpushm/internal/exitcode"
	"github.com/gpushm/gpushm/internal/testutil"
)

// TestEveryUserFindsTheNodesDaemon: a daemon run as root with no --socket
// listens on /run/gpushm/gpushm.sock, and a user with no daemon of its own
// reaches it with no $GPUSHM_SOCKET, with $XDG_RUNTIME_DIR set and unset.
// Everything runs in a private mount namespace with a tmpfs on /run, so
// that the test never touches the machine's /run/gpushm.
func TestEveryUserFindsTheNodesDaemon(t *testing.T) {
	requireRoot(t)
	for _, tool := range []string{"unshare", "nsenter", "setpriv"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("needs %s (util-linux): %v", tool, err)
		}
	}
	ns := privateRun(t)
	bin := binaryForOthers(t)
	const system = "/run/gpushm/gpushm.sock"
	const hint = " (is 'gpushm daemon' running? set $GPUSHM_SOCKET to choose a socket)\n"

	// Nobody's runtime directory, with no daemon in it, and a temporary
	// directory for nobody without one.
	home := testutil.SocketDir(t)
	os.Chmod(home, 0o755)
	xdg, tmp := filepath.Join(home, "xdg"), filepath.Join(home, "tmp")
	for _, d := range []string{xdg, tmp} {
		if err := os.Mkdir(d, 0o700); err != nil {
			t.Fatal(err)
		}
		os.Chown(d, 65534, 65534)
	}
	withXDG := []string{"XDG_RUNTIME_DIR=" + xdg}
	withoutXDG := []string{"TMPDIR=" + tmp}
	nobody := &syscall.Credential{Uid: 65534, Gid: 65534}

	// No daemon anywhere: every path tried, and the variable.
	r := ns.run(t, bin, nobody, withXDG, "info")
	if want := "gpushm: cannot reach a daemon: " + xdg + "/gpushm/gpushm.sock: no such file; " + system + ": no such file" + hint; r.code == 0 || r.stderr != want {
		t.Errorf("info as nobody with no daemon: exit %d, stderr %q\nwant %q", r.code, r.stderr, want)
	}
	r = ns.run(t, bin, nil, withXDG, "info")
	if want := "gpushm: cannot reach a daemon: " + system + ": no such file" + hint; r.code == 0 || r.stderr != want {
		t.Errorf("info as root with no daemon: exit %d, stderr %q\nwant %q (root's own socket is the system one, tried once)", r.code, r.stderr, want)
	}

	daemon := ns.startDaemon(t, bin)
	st, err := os.Stat(fmt.Sprintf("/proc/%d/root%s", daemon, system))
	if err != nil {
		t.Fatal(err)
	}
	if st.Mode()&os.ModeSocket == 0 || st.Mode().Perm() != 0o666 {
		t.Errorf("the daemon's socket %s is %v, want a socket of mode 0666 (every user may connect)", system, st.Mode())
	}
	dir, err := os.Stat(fmt.Sprintf("/proc/%d/root%s", daemon, filepath.Dir(system)))
	if err != nil {
		t.Fatal(err)
	}
	if dir.Mode().Perm() != 0o755 {
		t.Errorf("the socket's directory is %v, want 0755", dir.Mode())
	}

	for _, tc := range []struct {
		name string
		env  []string
	}{
		{"with XDG_RUNTIME_DIR", withXDG},
		{"without XDG_RUNTIME_DIR", withoutXDG},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := ns.run(t, bin, nobody, tc.env, "info")
			if r.code != 0 || !strings.Contains(r.stdout, " at "+system+"\n") {
				t.Fatalf("info as nobody: exit %d\n%s%s\nwant the daemon at %s", r.code, r.stdout, r.stderr, system)
			}
			if r := ns.run(t, bin, nobody, tc.env, "create", "found", "1K"); r.code != 0 {
				t.Fatalf("create as nobody: exit %d: %s", r.code, r.stderr)
			}
			r = ns.run(t, bin, nobody, tc.env, "ls")
			if r.code != 0 || !strings.Contains(r.stdout, "found") || !strings.Contains(r.stdout, "nobody") {
				t.Fatalf("ls as nobody: exit %d\n%s%s\nwant nobody's segment found", r.code, r.stdout, r.stderr)
			}
			if r := ns.run(t, bin, nobody, tc.env, "rm", "found"); r.code != 0 {
				t.Fatalf("rm as nobody: exit %d: %s", r.code, r.stderr)
			}
		})
	}

	// A user's own daemon answers first, and hides the node's: a name it
	// does not hold is said to be missing there, with where the node's
	// daemon listens.
	r = ns.run(t, bin, nobody, withXDG, "daemon", "--detach", "--backend", "host", "--nvml", "off", "--log-file", filepath.Join(xdg, "log"))
	m := regexp.MustCompile(`\(pid (\d+)\)`).FindStringSubmatch(r.stderr)
	if r.code != 0 || m == nil {
		t.Fatalf("nobody's own daemon --detach: exit %d: %s", r.code, r.stderr)
	}
	own, _ := strconv.Atoi(m[1])
	ns.run(t, bin, nil, nil, "create", "nodes-only", "1K")
	for _, args := range [][]string{{"ls", "nodes-only"}, {"stat", "nodes-only"}} {
		r = ns.run(t, bin, nobody, withXDG, args...)
		if r.code != exitcode.NotFound || !strings.Contains(r.stderr, "your own daemon at "+xdg+"/gpushm/gpushm.sock answered") ||
			!strings.Contains(r.stderr, "--socket "+system) {
			t.Errorf("%s as nobody, whose own daemon runs: exit %d, stderr %q; want not found, naming both daemons", args[0], r.code, r.stderr)
		}
	}
	syscall.Kill(own, syscall.SIGTERM)
	ns.run(t, bin, nil, nil, "rm", "nodes-only")

	// A socket that may be a daemon, but not for this user, ends the
	// search: the client says so rather than reach another daemon.
	closed := filepath.Join(home, "closed")
	if err := os.MkdirAll(filepath.Join(closed, "gpushm"), 0o700); err != nil {
		t.Fatal(err)
	}
	shut := filepath.Join(closed, "gpushm", "gpushm.sock")
	ln, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: shut, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	for _, p := range []string{closed, filepath.Dir(shut), shut} {
		os.Chown(p, 65534, 65534)
	}
	os.Chmod(shut, 0) // nobody's own, which nobody may not connect to
	r = ns.run(t, bin, nobody, []string{"XDG_RUNTIME_DIR=" + closed}, "info")
	denied := " (a daemon's socket is there, but this user may not connect: its group and mode say who may, as 'ls -l' shows; see 'gpushm daemon --socket-group')\n"
	if want := "gpushm: cannot reach a daemon: " + closed + "/gpushm/gpushm.sock: permission denied" + denied; r.code != 4 || r.stderr != want {
		t.Errorf("info as nobody whose own socket it may not reach: exit %d, stderr %q\nwant %q", r.code, r.stderr, want)
	}
}

// mountNS is a private mount namespace with a tmpfs on /run, held by a
// process of the test's until the test ends.
type mountNS struct{ holder int }

// privateRun makes a mountNS, or skips the test where it may not.
func privateRun(t *testing.T) *mountNS {
	t.Helper()
	if out, err := exec.Command("unshare", "--mount", "--propagation", "private", "true").CombinedOutput(); err != nil {
		t.Skipf("this machine does not let us make a mount namespace: %v %s", err, out)
	}
	// A tmpfs on /run itself, not on /run/gpushm: that would need the
	// directory made in the machine's /run.
	cmd := exec.Command("unshare", "--mount", "--propagation", "private", "sh", "-c",
		"mount -t tmpfs -o mode=0755 gpushm-test /run && echo ready && exec sleep 3600")
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
	})
	if line, _ := bufio.NewReader(out).ReadString('\n'); line != "ready\n" {
		cmd.Process.Kill()
		cmd.Wait()
		t.Skipf("cannot mount a tmpfs on /run in a mount namespace: %s", stderr.String())
	}
	return &mountNS{holder: cmd.Process.Pid}
}

// command is bin with args in the namespace, as cred (nil: root), with the
// test's environment less any socket, runtime or temporary directory, plus
// env.
func (ns *mountNS) command(bin string, cred *syscall.Credential, env []string, args ...string) *exec.Cmd {
	enter := []string{"--mount=/proc/" + fmt.Sprint(ns.holder) + "/ns/mnt", "--"}
	if cred != nil {
		enter = append(enter, "setpriv", "--reuid", fmt.Sprint(cred.Uid), "--regid", fmt.Sprint(cred.Gid), "--clear-groups")
	}
	cmd := exec.Command("nsenter", append(append(enter, bin), args...)...)
	for _, kv := range os.Environ() {
		switch strings.SplitN(kv, "=", 2)[0] {
		case "GPUSHM_SOCKET", "XDG_RUNTIME_DIR", "TMPDIR":
		default:
			cmd.Env = append(cmd.Env, kv)
		}
	}
	cmd.Env = append(cmd.Env, env...)
	return cmd
}

// run runs bin with args in the namespace (see command) and waits for it.
func (ns *mountNS) run(t *testing.T, bin string, cred *syscall.Credential, env []string, args ...string) result {
	t.Helper()
	return runCmd(t, ns.command(bin, cred, env, args...))
}

// startDaemon runs 'gpushm daemon' as root in the namespace, on its
// default socket, until the test ends, and returns its pid once it
// answers.
func (ns *mountNS) startDaemon(t *testing.T, bin string) int {
	t.Helper()
	// One process (no supervisor), so that ending it ends the daemon.
	cmd := ns.command(bin, nil, nil, "daemon", "--backend", "host", "--supervise=false", "--nvml", "off")
	log := &syncBuffer{}
	cmd.Stderr = log
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Signal(syscall.SIGTERM)
		done := make(chan struct{})
		go func() { cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			cmd.Process.Kill()
			<-done
		}
		testutil.DumpDaemonLog(t, log.String())
	})
	for i := 0; ns.run(t, bin, nil, nil, "info").code != 0; i++ {
		if i > 500 {
			t.Fatalf("daemon never answered on its default socket: %s", log.String())
		}
		time.Sleep(10 * time.Millisecond)
	}
	return cmd.Process.Pid
}

// TestPutNeverReachesASquatter: a user with no $GPUSHM_SOCKET nor
// $XDG_RUNTIME_DIR (cron, su, batch jobs) looks for its own socket in
// $TMPDIR/gpushm-UID. Another user made that directory first and runs an
// ordinary daemon there: the victim's put of a private file skips it,
// saying why, and lands in the node's daemon; the squatter's daemon holds
// nothing.
func TestPutNeverReachesASquatter(t *testing.T) {
	requireRoot(t)
	for _, tool := range []string{"unshare", "nsenter", "setpriv"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("needs %s (util-linux): %v", tool, err)
		}
	}
	ns := privateRun(t)
	bin := binaryForOthers(t)
	ns.startDaemon(t, bin)
	const victim, squatter = 4242, 4243
	asVictim := &syscall.Credential{Uid: victim, Gid: victim}
	asSquatter := &syscall.Credential{Uid: squatter, Gid: squatter}

	tmp := testutil.SocketDir(t) // the victim's $TMPDIR, open to all as /tmp is
	os.Chmod(tmp, 0o777|os.ModeSticky)
	mkdir := func(dir string, mode os.FileMode, uid int) {
		if err := os.Mkdir(dir, mode); err != nil {
			t.Fatal(err)
		}
		os.Chown(dir, uid, uid)
		os.Chmod(dir, mode)
	}
	own := filepath.Join(tmp, fmt.Sprint("gpushm-", victim))
	mkdir(own, 0o755, squatter)
	sock := filepath.Join(own, "gpushm.sock")
	daemon := exec.Command(bin, "daemon", "--socket", sock, "--backend", "host", "--supervise=false", "--nvml", "off")
	daemon.SysProcAttr = &syscall.SysProcAttr{Credential: asSquatter}
	if err := daemon.Start(); err != nil {
		t.Fatal(err)
	}
	defer testutil.KillDaemon(sock, daemon)
	squatterRun := func(args ...string) result {
		cmd := exec.Command(bin, append([]string{"--socket", sock}, args...)...)
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: asSquatter}
		return runCmd(t, cmd)
	}
	for i := 0; squatterRun("info").code != 0; i++ {
		if i > 500 {
			t.Fatal("the squatter's daemon never answered")
		}
		time.Sleep(10 * time.Millisecond)
	}

	home := filepath.Join(tmp, "home")
	mkdir(home, 0o700, victim)
	secret := filepath.Join(home, "secret.bin")
	if err := os.WriteFile(secret, []byte("the victim's private bytes"), 0o600); err != nil {
		t.Fatal(err)
	}
	os.Chown(secret, victim, victim)
	r := ns.run(t, bin, asVictim, []string{"TMPDIR=" + tmp}, "put", "secret", secret)
	if r.code != 0 {
		t.Fatalf("put as the victim: exit %d: %s", r.code, r.stderr)
	}
	if r = ns.run(t, bin, nil, nil, "ls", "secret"); r.code != 0 || !strings.Contains(r.stdout, "secret") {
		t.Errorf("the node's daemon lacks the victim's put: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	// Nothing but the header.
	if r = squatterRun("ls"); r.code != 0 || strings.Count(strings.TrimSpace(r.stdout), "\n") != 0 {
		t.Errorf("the squatter's daemon holds something: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
}

// TestUsersOwnDaemon: a daemon a user runs with no --socket makes its
// directory, $TMPDIR/gpushm-UID, the user's alone (0700), which the user's
// clients then trust and find with no --socket either.
func TestUsersOwnDaemon(t *testing.T) {
	requireRoot(t)
	bin := binaryForOthers(t)
	const user = 4242
	cred := &syscall.Credential{Uid: user, Gid: user}
	tmp := testutil.SocketDir(t)
	os.Chmod(tmp, 0o777|os.ModeSticky)
	env := []string{"TMPDIR=" + tmp}
	for _, kv := range os.Environ() {
		if k, _, _ := strings.Cut(kv, "="); k != "GPUSHM_SOCKET" && k != "XDG_RUNTIME_DIR" && k != "TMPDIR" {
			env = append(env, kv)
		}
	}
	own := filepath.Join(tmp, fmt.Sprint("gpushm-", user))
	sock := filepath.Join(own, "gpushm.sock")
	daemon := exec.Command(bin, "daemon", "--backend", "host", "--supervise=false", "--nvml", "off")
	daemon.Env, daemon.SysProcAttr = env, &syscall.SysProcAttr{Credential: cred}
	if err := daemon.Start(); err != nil {
		t.Fatal(err)
	}
	defer testutil.KillDaemon(sock, daemon)
	info := func() result {
		cmd := exec.Command(bin, "info")
		cmd.Env, cmd.SysProcAttr = env, &syscall.SysProcAttr{Credential: cred}
		return runCmd(t, cmd)
	}
	r := info()
	for i := 0; r.code != 0; i++ {
		if i > 500 {
			t.Fatalf("the user's own daemon never answered on %s: %s", sock, r.stderr)
		}
		time.Sleep(10 * time.Millisecond)
		r = info()
	}
	if !strings.Contains(r.stdout, " at "+sock+"\n") {
		t.Errorf("info as the user found another daemon than its own:\n%s", r.stdout)
	}
	st, err := os.Stat(own)
	if err != nil {
		t.Fatal(err)
	}
	if st.Mode().Perm() != 0o700 || st.Sys().(*syscall.Stat_t).Uid != user {
		t.Errorf("the user's daemon made %s %v, owned by uid %d; want 0700, the user's", own, st.Mode(), st.Sys().(*syscall.Stat_t).Uid)
	}
}
