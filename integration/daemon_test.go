package integration

import (
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"testing"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/exitcode"
	"github.com/gpushm/gpushm/internal/testutil"
	"golang.org/x/sys/unix"
)

func TestDaemonReplacesStaleSocket(t *testing.T) {
	sock := filepath.Join(testutil.SocketDir(t), "gpushm.sock")
	fd, _ := unix.Socket(unix.AF_UNIX, unix.SOCK_SEQPACKET, 0)
	if err := unix.Bind(fd, &unix.SockaddrUnix{Name: sock}); err != nil {
		t.Fatal(err)
	}
	unix.Close(fd)
	Start(t, Options{Socket: sock})
	mustRun(t, nil, "--socket", sock, "create", "x", "1K")
}

func TestDemo(t *testing.T) {
	out := mustRun(t, nil, "demo", "--backend", "host", "--size", "8MiB")
	for _, want := range []string{"2nd process: open by name", "verified: both processes", "daemon holds 0 segments"} {
		if !strings.Contains(out, want) {
			t.Fatalf("demo output lacks %q:\n%s", want, out)
		}
	}
}

func TestBenchOpen(t *testing.T) {
	out := mustRun(t, nil, "bench", "open", "--backend", "host", "--sizes", "64KiB,1MiB", "--iters", "5")
	if !strings.Contains(out, "open/floor") || !strings.Contains(out, "64 KiB") || !strings.Contains(out, "1 MiB") {
		t.Fatalf("bench output:\n%s", out)
	}
}

func TestMetricsEndpoint(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	sock := filepath.Join(testutil.SocketDir(t), "gpushm.sock")
	Start(t, Options{Socket: sock, Args: []string{"--metrics-listen", addr}})
	mustRun(t, nil, "--socket", sock, "create", "m", "1M")
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	for _, want := range []string{
		`gpushm_segment_bytes{device="0",named="true",uid="0",user="root",uuid=""} 1.048576e+06`,
		`gpushm_operations_total{code="OK",op="create"} 1`,
		`gpushm_device_memory_total_bytes{device="0",name="host memory",uuid=""}`,
		`gpushm_operation_duration_seconds_bucket{op="create"`,
		`gpushm_build_info{backend="host",goversion="` + runtime.Version() + `",version="` + gpushm.Version() + `"} 1`,
	} {
		if !strings.Contains(string(body), want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
}

func TestSocketGroupAndWideList(t *testing.T) {
	sock := filepath.Join(testutil.SocketDir(t), "gpushm.sock")
	Start(t, Options{Socket: sock, Args: []string{"--socket-group", "nogroup"}})
	st, err := os.Stat(sock)
	if err != nil {
		t.Fatal(err)
	}
	sys := st.Sys().(*syscall.Stat_t)
	if st.Mode().Perm() != 0o660 || sys.Gid != 65534 {
		t.Fatalf("socket mode %v gid %d, want 0660 and nogroup (65534)", st.Mode().Perm(), sys.Gid)
	}
	mustRun(t, nil, "--socket", sock, "create", "w", "1K")
	out := mustRun(t, nil, "--socket", sock, "ls", "--wide")
	if !strings.Contains(out, "GPU") || !strings.Contains(out, "host memory") {
		t.Fatalf("ls --wide:\n%s", out)
	}
	mustFail(t, "socket group", "daemon", "--socket", sock+"2", "--backend", "host", "--socket-group", "no-such-group-here")

	// A user outside the group: permission denied (exit 4), said as such,
	// not as no daemon (exit 8).
	os.Chmod(filepath.Dir(sock), 0o755)
	ls := exec.Command(binaryForOthers(t), "--socket", sock, "ls")
	ls.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65533, Gid: 65533}}
	if r := runCmd(t, ls); r.code != exitcode.Permission || !strings.Contains(r.stderr, "this user may not connect") ||
		strings.Contains(r.stderr, "is 'gpushm daemon' running") {
		t.Errorf("ls by a user outside the socket's group: exit %d, stderr %q; want %d, permission denied said", r.code, r.stderr,
			exitcode.Permission)
	}
}
