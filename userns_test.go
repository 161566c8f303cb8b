package gpushm_test

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/testdaemon"
)

// tenantUID is the host uid the containerised client runs as.
const tenantUID = 4242

// inContainer runs ops (as asUser does) in a copy of this test binary that
// runs as it would in a rootless container: host uid tenantUID, root in a
// user namespace of its own (unshare --map-root-user), with the daemon's
// socket directory bind-mounted into its own mount namespace at /mnt.
func inContainer(t *testing.T, socket string, ops ...string) []string {
	t.Helper()
	script := `mount --bind "$SOCKET_DIR" /mnt && GPUSHM_SOCKET=/mnt/` + filepath.Base(socket) + ` exec "$0" -test.run='^$'`
	out := container(t, filepath.Dir(socket), script, "GPUSHM_TEST_CHILD=ops", "OPS="+strings.Join(ops, " "))
	return strings.Fields(out)
}

// container runs a copy of this test binary as root of a user namespace
// of its own (host uid tenantUID) and in a mount namespace of its own,
// through script (sh -c, the binary as $0, the daemon's socket directory
// as $SOCKET_DIR), with env and no $GPUSHM_SOCKET but what script sets. It
// returns what the binary prints.
func container(t *testing.T, socketDir, script string, env ...string) string {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("starting a client as another user needs root")
	}
	for _, tool := range []string{"setpriv", "unshare"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("needs %s (util-linux): %v", tool, err)
		}
	}
	enter := []string{"setpriv", "--reuid", "4242", "--regid", "4242", "--clear-groups",
		"unshare", "--user", "--map-root-user", "--mount"}
	if out, err := exec.Command(enter[0], append(enter[1:], "true")...).CombinedOutput(); err != nil {
		t.Skipf("this kernel does not let uid %d make a user namespace: %v %s", tenantUID, err, out)
	}
	// Not t.TempDir: its parent is private to us.
	dir, err := os.MkdirTemp("", "gpushm-userns-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	os.Chmod(dir, 0o755)
	bin := filepath.Join(dir, "client")
	data, err := os.ReadFile(os.Args[0])
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(bin, data, 0o755); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(enter[0], append(enter[1:], "sh", "-c", script, bin)...)
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "GPUSHM_SOCKET=") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	cmd.Env = append(cmd.Env, "SOCKET_DIR="+socketDir)
	cmd.Env = append(cmd.Env, env...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, os.Stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("client in a user namespace: %v", err)
	}
	return out.String()
}

// TestRootInAUserNamespace: a client that is root in its own user
// namespace, as in a rootless container or a pod with user namespaces, has
// the rights of its host uid and no more. SO_PEERCRED reports credentials
// as the daemon's namespace sees them.
func TestRootInAUserNamespace(t *testing.T) {
	d := testdaemon.Start(t, "host")
	ctx := context.Background()
	c := dial(t, d.Socket)
	mode := func(m uint32) *gpushm.CreateOptions { return &gpushm.CreateOptions{Mode: &m} }
	for name, m := range map[string]uint32{"root-private": 0o600, "root-readable": 0o644, "tenant": 0o600} {
		if _, _, err := c.CreateOnly(ctx, name, 4096, mode(m)); err != nil {
			t.Fatal(err)
		}
	}
	if err := c.Chown(ctx, "tenant", tenantUID, tenantUID); err != nil {
		t.Fatal(err)
	}
	got := inContainer(t, d.Socket,
		"uid",                   // root, in there
		"open-ro:root-private",  // root's 0600: not for uid 4242
		"open-ro:root-readable", // 0644: anyone may read
		"open-rw:root-readable", // but not write
		"unlink:root-readable",  // nor remove
		"open-rw:tenant",        // its own host uid's
		"chown:tenant",          // giving a segment away is for the host's root
		"create:made-in-a-container",
	)
	want := []string{"uid=0", "EACCES", "OK", "EACCES", "EPERM", "OK", "EPERM", "OK"}
	if strings.Join(got, " ") != strings.Join(want, " ") {
		t.Fatalf("client as root of a user namespace got %v, want %v", got, want)
	}
	inf, err := c.Stat(ctx, "made-in-a-container")
	if err != nil {
		t.Fatal(err)
	}
	if inf.UID != tenantUID || inf.GID != tenantUID {
		t.Fatalf("a segment created in the container is owned by %d:%d, want the host's %d:%d", inf.UID, inf.GID, tenantUID, tenantUID)
	}
}

// TestNodesDaemonFromAUserNamespace: in a user namespace that does not map
// root (a pod with hostUsers: false, a rootless container), the node's
// daemon, and its directory, read as the overflow uid, as does every other
// user the namespace does not map. Found by convention, such a socket is
// refused, before anything is sent, with the variable that trusts it;
// given in $GPUSHM_SOCKET, it is the operator's mount, and trusted.
func TestNodesDaemonFromAUserNamespace(t *testing.T) {
	dir, err := os.MkdirTemp("", "gpushm-node-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	os.Chmod(dir, 0o755)
	d := testdaemon.StartAt(t, "host", filepath.Join(dir, "gpushm.sock"))
	overflow := "65534"
	if b, err := os.ReadFile("/proc/sys/kernel/overflowuid"); err == nil {
		overflow = strings.TrimSpace(string(b))
	}
	const (
		node = gpushm.SystemSocket
		run  = `mount -t tmpfs -o mode=0755 gpushm-test /run && mkdir /run/gpushm && `
		// The node's directory at its path, as a pod's hostPath.
		hostPath = run + `mount --bind "$SOCKET_DIR" /run/gpushm && `
		// The socket alone, in a directory of the container's root.
		socketOnly = run + `touch /run/gpushm/gpushm.sock && mount --bind "$SOCKET_DIR/gpushm.sock" /run/gpushm/gpushm.sock && `
		child      = `exec "$0" -test.run='^$'`
		given      = `GPUSHM_SOCKET=` + node + ` `
		unsure     = ": root's, or any user this user namespace does not map: "
		hint       = " (is 'gpushm daemon' running? set $GPUSHM_SOCKET to choose a socket)"
	)
	tests := []struct{ name, script, want string }{
		{"the hostPath, found", hostPath + child, "untrusted=true: gpushm: cannot reach a daemon: /run/gpushm: owned by uid " + overflow +
			", the overflow uid" + unsure + "skipped (set GPUSHM_SOCKET=" + node + " to trust it)" + hint},
		{"the socket alone, found", socketOnly + child, "untrusted=true: gpushm: cannot reach a daemon: " + node + ": the daemon answering reads as uid " +
			overflow + ", the overflow uid" + unsure + "refused, nothing sent (set GPUSHM_SOCKET=" + node + " to trust it)" + hint},
		{"the hostPath, given", hostPath + given + child, "reached " + node},
		{"the socket alone, given", socketOnly + given + child, "reached " + node},
	}
	for i, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			name := fmt.Sprintf("from-a-pod-%d", i)
			got := strings.TrimSpace(container(t, dir, tc.script, "GPUSHM_TEST_CHILD=dial", "GPUSHM_TIMEOUT=5s", "NAME="+name))
			if got != tc.want {
				t.Fatalf("client as root of a user namespace: %s\nwant %s", got, tc.want)
			}
			_, err := d.Server.Registry().Stat(name)
			if reached := strings.HasPrefix(tc.want, "reached"); reached != (err == nil) {
				t.Fatalf("the node's daemon holds the client's segment: %t (%v), want %t", err == nil, err, reached)
			}
		})
	}
}
