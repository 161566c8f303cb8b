package integration

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gpushm/gpushm/internal/nvml/nvmltest"
	"github.com/gpushm/gpushm/internal/testutil"
)

// These tests start the daemon as operators do on a fleet: with NVML (a
// fake libnvidia-ml.so.1 found through LD_LIBRARY_PATH, as the loader finds
// the real one), and with the bad input a node can hand it at start.

// freePort is a TCP address nobody listens on.
func freePort(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

func scrape(t *testing.T, addr string) string {
	t.Helper()
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return string(body)
}

func requireRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root, to run processes as other users")
	}
}

func TestNVMLInInfoAndMetrics(t *testing.T) {
	requireRoot(t)
	t.Setenv("LD_LIBRARY_PATH", nvmltest.Build(t))
	// A process of nobody's "using" GPU 0, and one the daemon cannot see.
	sleeper := exec.Command("sleep", "60")
	sleeper.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	if err := sleeper.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { sleeper.Process.Kill(); sleeper.Wait() }()
	t.Setenv(nvmltest.ModeEnv, "ok")
	t.Setenv(nvmltest.PIDsEnv, fmt.Sprintf("%d:1048576,4194303:3145728", sleeper.Process.Pid))

	dir := testutil.SocketDir(t)
	os.Chmod(dir, 0o755) // for the client running as nobody
	sock := filepath.Join(dir, "gpushm.sock")
	addr := freePort(t)
	log := Start(t, Options{Socket: sock, Args: []string{"--metrics-listen", addr}}).log
	if !strings.Contains(log.String(), `msg=NVML role=server library=libnvidia-ml.so.1 driver=999.99.99-fake`) {
		t.Errorf("the daemon does not log the NVML it uses:\n%s", log)
	}
	out := mustRun(t, nil, "--socket", sock, "info")
	for _, want := range []string{
		"GPUs from NVML, driver 999.99.99-fake",
		"0    -       Fake GPU A  " + nvmltest.UUID0 + "  3 GiB    80 GiB  42%",
		"1    -       Fake GPU B  " + nvmltest.UUID1 + "  512 MiB  80 GiB  -",
		// The largest first; a process the daemon cannot see has no name.
		"GPU  PID      USER    COMMAND  GPU MEMORY\n0    4194303  -       -        3 MiB\n",
		fmt.Sprintf("0    %-7d  nobody  sleep    1 MiB", sleeper.Process.Pid),
	} {
		if !strings.Contains(out, want) {
			t.Errorf("info lacks %q:\n%s", want, out)
		}
	}
	// Another user sees only its own processes: nobody's sleep, not the
	// one whose owner the daemon cannot tell.
	asNobody := exec.Command(binaryForOthers(t), "--socket", sock, "info")
	asNobody.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	if b, err := asNobody.CombinedOutput(); err != nil {
		t.Errorf("info as nobody: %v\n%s", err, b)
	} else if out := strings.Join(strings.Fields(string(b)), " "); !strings.Contains(out, fmt.Sprintf("0 %d nobody sleep 1 MiB 0 ... 1 more", sleeper.Process.Pid)) {
		t.Errorf("info as nobody should list nobody's process and count the other:\n%s", out)
	}
	body := scrape(t, addr)
	for _, want := range []string{
		`gpushm_gpu_source_info{driver="999.99.99-fake",source="nvml"} 1`,
		`gpushm_gpu_memory_used_bytes{device="",gpu="0",name="Fake GPU A",uuid="` + nvmltest.UUID0 + `"} 3.221225472e+09`,
		`gpushm_gpu_utilization_ratio{device="",gpu="0",name="Fake GPU A",uuid="` + nvmltest.UUID0 + `"} 0.42`,
		fmt.Sprintf(`gpushm_gpu_process_memory_bytes{command="sleep",device="",gpu="0",pid="%d",uid="65534",user="nobody",uuid="%s"} 1.048576e+06`,
			sleeper.Process.Pid, nvmltest.UUID0),
	} {
		if !strings.Contains(body, want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
	if strings.Contains(body, `gpushm_gpu_utilization_ratio{device="",gpu="1"`) {
		t.Error("/metrics reports a utilisation NVML does not know")
	}
}

// TestNVMLFailingAtStart: the library is there, but NVML does not work.
func TestNVMLFailingAtStart(t *testing.T) {
	t.Setenv("LD_LIBRARY_PATH", nvmltest.Build(t))
	t.Setenv(nvmltest.ModeEnv, "init-fails")
	dir := testutil.SocketDir(t)

	// auto: serve without NVML, and say so in the log and in info.
	sock := filepath.Join(dir, "auto.sock")
	log := Start(t, Options{Socket: sock}).log
	if want := `level=WARN msg="NVML failed; serving without it, with no GPU figures" role=server err="nvmlInit: Driver Not Loaded (NVML error 9)"`; !strings.Contains(log.String(), want) {
		t.Errorf("daemon log lacks %s:\n%s", want, log)
	}
	out := mustRun(t, nil, "--socket", sock, "info")
	if !strings.Contains(out, "GPUs: none reported\nnote: host memory backend; NVML failed: nvmlInit: Driver Not Loaded (NVML error 9)") {
		t.Errorf("info does not say why there are no GPU figures:\n%s", out)
	}

	// require: refuse to start, leaving nothing behind.
	sock = filepath.Join(dir, "require.sock")
	refuses(t, gpushmBin, nil, sock, "--nvml require: nvmlInit: Driver Not Loaded (NVML error 9)", "--nvml", "require")
	refuses(t, gpushmBin, nil, sock, "--nvml require: nvml unavailable: /nonexistent/libnvidia-ml.so.1: cannot open shared object file",
		"--nvml", "require", "--nvml-library", "/nonexistent/libnvidia-ml.so.1")
	refuses(t, gpushmBin, nil, sock, `--nvml "on": want auto, require or off`, "--nvml", "on")
}

// refuses runs a daemon (bin, as cred: nil for us) that must exit at
// start with an error mentioning want, without serving, and without
// leaving its socket behind.
func refuses(t *testing.T, bin string, cred *syscall.Credential, socket, want string, args ...string) {
	t.Helper()
	cmd := exec.Command(bin, append([]string{"daemon", "--socket", socket, "--backend", "host"}, args...)...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	var err error
	select {
	case err = <-done:
	case <-time.After(30 * time.Second):
		cmd.Process.Kill()
		<-done
		t.Fatalf("daemon %v did not refuse to start within 30s: %s", args, stderr.String())
	}
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 1 {
		t.Fatalf("daemon %v: %v, want exit 1; stderr: %s", args, err, stderr.String())
	}
	last := strings.TrimSpace(stderr.String())
	if i := strings.LastIndex(last, "\n"); i >= 0 {
		last = last[i+1:]
	}
	if !strings.HasPrefix(last, "gpushm: ") || !strings.Contains(last, want) {
		t.Fatalf("daemon %v said %q; want a last line mentioning %q", args, last, want)
	}
	if _, err := os.Lstat(socket); !errors.Is(err, os.ErrNotExist) && !errors.Is(err, syscall.ENOTDIR) {
		t.Fatalf("daemon %v left %s behind (%v)", args, socket, err)
	}
}

// binaryForOthers copies the test binary where other users can run it,
// for the test's duration: go test builds it in a directory only we can
// read.
func binaryForOthers(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "gpushm-bin-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	os.Chmod(dir, 0o755)
	data, err := os.ReadFile(gpushmBin)
	if err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(dir, "gpushm")
	if err := os.WriteFile(bin, data, 0o755); err != nil {
		t.Fatal(err)
	}
	return bin
}

func TestBadStart(t *testing.T) {
	requireRoot(t)
	dir := testutil.SocketDir(t)
	os.Chmod(dir, 0o755)
	mkdir := func(name string, mode os.FileMode, uid int) string {
		p := filepath.Join(dir, name)
		if err := os.Mkdir(p, 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(p, mode); err != nil {
			t.Fatal(err)
		}
		if err := os.Chown(p, uid, uid); err != nil {
			t.Fatal(err)
		}
		return p
	}
	file := filepath.Join(dir, "file")
	os.WriteFile(file, nil, 0o644)
	rootOnly := mkdir("root-only", 0o755, 0)          // a hostPath as the kubelet makes it
	open := mkdir("open", 0o777, 0)                   // anyone could replace the socket
	sticky := mkdir("sticky", 0o777|os.ModeSticky, 0) // like /tmp: fine
	others := mkdir("others", 0o755, 4242)            // another user's
	nobody := &syscall.Credential{Uid: 65534, Gid: 65534}
	asNobody := binaryForOthers(t)

	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()

	tests := []struct {
		name   string
		cred   *syscall.Credential
		socket string
		args   []string
		want   string
	}{
		{"directory under a file", nil, filepath.Join(file, "run", "gpushm.sock"), nil,
			"create socket directory: mkdir " + file + ": not a directory"},
		{"directory that cannot be created", nobody, filepath.Join(rootOnly, "sub", "gpushm.sock"), nil,
			"create socket directory: mkdir " + rootOnly + "/sub: permission denied"},
		{"hostPath not writable by the daemon", nobody, filepath.Join(rootOnly, "gpushm.sock"), nil,
			"socket directory " + rootOnly + " (owner uid 0, mode 0755) is not writable by the daemon's uid 65534"},
		{"hostPath open to all", nil, filepath.Join(open, "gpushm.sock"), nil,
			"socket directory " + open + " (mode 0777) lets group or others replace the socket"},
		{"hostPath of another user", nil, filepath.Join(others, "gpushm.sock"), nil,
			"socket directory " + others + " belongs to uid 4242, who could replace the socket"},
		{"metrics port in use", nil, filepath.Join(rootOnly, "gpushm.sock"), []string{"--metrics-listen", busy.Addr().String()},
			"--metrics-listen " + busy.Addr().String() + ": the port is in use"},
		{"metrics address bad", nil, filepath.Join(rootOnly, "gpushm.sock"), []string{"--metrics-listen", "nonsense"},
			"--metrics-listen nonsense: listen tcp: address nonsense: missing port in address"},
		{"FUSE view that cannot be mounted", nil, filepath.Join(rootOnly, "gpushm.sock"), []string{"--mount", filepath.Join(file, "mnt")},
			"mount point: stat " + file + "/mnt: not a directory"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			bin := gpushmBin
			if tc.cred != nil {
				bin = asNobody
			}
			refuses(t, bin, tc.cred, tc.socket, tc.want, tc.args...)
		})
	}

	// What the daemon accepts: a sticky directory, and its own directory
	// as a non-root user (the container's hostPath, chowned to it).
	Start(t, Options{Socket: filepath.Join(sticky, "gpushm.sock")})
	own := mkdir("own", 0o755, 65534)
	sock := filepath.Join(own, "gpushm.sock")
	cmd := exec.Command(asNobody, "daemon", "--socket", sock, "--backend", "host")
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: nobody}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer testutil.KillDaemon(sock, cmd)
	// Other users' clients, root's too, trust a daemon of a user not
	// theirs only when GPUSHM_DAEMON_UID names it: a dedicated user's.
	t.Setenv("GPUSHM_DAEMON_UID", "65534")
	for i := 0; cli(t, nil, "--socket", sock, "info").code != 0; i++ {
		if i > 500 {
			t.Fatal("a non-root daemon in its own directory never answered")
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Setenv("GPUSHM_DAEMON_UID", "")
	want := "gpushm: " + sock + ": the daemon answering runs as uid 65534, neither you (uid 0) nor root: refused, nothing sent" +
		" (another user may run it; set GPUSHM_DAEMON_UID=65534 if that user runs the node's daemon)\n"
	if r := cli(t, nil, "--socket", sock, "info"); r.code == 0 || r.stderr != want {
		t.Errorf("info as root at nobody's daemon: exit %d, stderr %q\nwant %q", r.code, r.stderr, want)
	}
}
