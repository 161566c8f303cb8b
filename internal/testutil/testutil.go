// Package testutil holds what the tests of several packages share, written
// once: waiting for a condition (WaitFor), a client that speaks the
// protocol by hand (Raw), the FUSE tests' requirement (RequireFUSE) and
// safetensors shards (WriteShard). Only tests import it; a daemon to test
// against is internal/testdaemon's.
package testutil

import (
	"os"
	"testing"
	"time"
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
