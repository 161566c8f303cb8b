// Package testutil holds what the tests of several packages share, written
// once: waiting for a condition (WaitFor), a client that speaks the
// protocol by hand (Raw), the FUSE tests' requirement (RequireFUSE) and the
// pulls' (RequireUCX), a
// copy of the test binary that other users can run (BinaryForOthers),
// safetensors shards (WriteShard) and files (SafetensorsFile, SparseFile),
// and a daemon's processes found and killed (DaemonProcs, KillDaemon), its
// socket's directory (SocketDir) and its log (DumpDaemonLog), and a
// network of namespaces for nodes that talk over TCP (NetNamespaces). Only tests
// import it; a daemon to test against is internal/testdaemon's, or, as
// processes, integration/'s Start.
package testutil

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/gpushm/gpushm/internal/ucx"
)

// WaitFor waits until ok holds, for 20 seconds at most (a second process
// under the race detector on a busy machine is slow to start), and fails
// the test naming what it waited for if it never does.
func WaitFor(t testing.TB, what string, ok func() bool) {
	t.Helper()
	for deadline := time.Now().Add(20 * time.Second); !ok(); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("no %s within 20s", what)
		}
	}
}

// RequireFUSE skips, saying why, where a real mount cannot be made: the
// FUSE tests mount without fusermount, which needs root and /dev/fuse.
func RequireFUSE(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("FUSE tests mount without fusermount: they need root")
	}
	if _, err := os.Stat("/dev/fuse"); err != nil {
		t.Skipf("FUSE tests need /dev/fuse: %v", err)
	}
}

// RequireUCX skips, saying why, where libucp.so.0 cannot be loaded: pulls
// move bytes over UCX (scripts/test installs Debian's libucx0).
func RequireUCX(t testing.TB) {
	t.Helper()
	if err := ucx.Load(); err != nil {
		t.Skipf("UCX not usable: %v", err)
	}
}

// BinaryForOthers copies this test binary to a directory every user may
// read and returns the copy's path, for tests that run it as another user:
// the binary usually sits in a directory only its owner can read. The copy
// goes when the test ends.
func BinaryForOthers(t testing.TB) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "gpushm-users-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	self, err := os.ReadFile(os.Args[0])
	if err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(dir, "client")
	if err := os.WriteFile(bin, self, 0o755); err != nil {
		t.Fatal(err)
	}
	return bin
}
