package gpushm_test

import (
	"bytes"
	"context"
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
	script := `mount --bind "$SOCKET_DIR" /mnt && GPUSHM_SOCKET=/mnt/` + filepath.Base(socket) + ` exec "$0" -test.run='^$'`
	cmd := exec.Command(enter[0], append(enter[1:], "sh", "-c", script, bin)...)
	cmd.Env = append(os.Environ(), "GPUSHM_TEST_CHILD=ops", "SOCKET_DIR="+filepath.Dir(socket), "OPS="+strings.Join(ops, " "))
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, os.Stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("client in a user namespace: %v", err)
	}
	return strings.Fields(out.String())
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
