package cli

import (
	"path/filepath"
	"testing"

	"github.com/gpushm/gpushm/internal/exitcode"
	"github.com/gpushm/gpushm/internal/testutil"
)

// TestMvNoClobber: mv -n renames only onto a name that is not there, and
// says so, with status 5, when it is.
func TestMvNoClobber(t *testing.T) {
	sock := filepath.Join(testutil.SocketDir(t), "gpushm.sock")
	startDaemonProc(t, sock)
	t.Setenv("GPUSHM_SOCKET", sock)
	mustRun(t, nil, "create", "a", "4096")
	mustRun(t, nil, "create", "b", "8192")

	r := cli(t, nil, "mv", "-n", "a", "b")
	if r.code != exitcode.Exists || r.stderr != "gpushm: mv a: b exists (-n leaves it)\n" {
		t.Errorf("mv -n a b: exit %d, %q", r.code, r.stderr)
	}
	r = cli(t, nil, "mv", "--no-clobber", "a", "b", "-o", "json")
	if r.stderr != `{"error":"mv a: b exists (-n leaves it)","code":"EEXIST","exit":5}`+"\n" {
		t.Errorf("mv --no-clobber a b -o json: %q", r.stderr)
	}
	var b map[string]any
	decode(t, mustRun(t, nil, "stat", "b", "-o", "json"), &b)
	if b["size"] != float64(8192) {
		t.Errorf("b after mv -n a b: %v, want it as it was", b)
	}
	if out := mustRun(t, nil, "mv", "-n", "a", "c", "-o", "name"); out != "c\n" {
		t.Errorf("mv -n a c -o name said %q", out)
	}
	if out := mustRun(t, nil, "ls", "-o", "name"); out != "b\nc\n" {
		t.Errorf("ls after mv -n a c: %q", out)
	}
}
