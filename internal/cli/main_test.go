package cli

import (
	"bytes"
	"crypto/sha256"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/gpushm/gpushm/internal/bytesize"
	"github.com/gpushm/gpushm/internal/testutil"
)

// The commands run in the test's process, through Main, their output in
// buffers (cli). What needs a process of its own runs this test binary
// again, which with GPUSHM_TEST_MAIN set is gpushm: a daemon
// (startDaemonProc), a command that reads standard input or is read
// through a terminal or a pipe, another user's command. The daemon as
// processes (crashes, upgrades, limits, users) is tested in integration/.
func TestMain(m *testing.M) {
	if os.Getenv("GPUSHM_TEST_MAIN") != "" {
		os.Exit(Main(os.Args[1:]))
	}
	os.Setenv("GPUSHM_TEST_MAIN", "1")
	os.Exit(m.Run())
}

type result struct {
	stdout, stderr string
	code           int
}

// mainMu keeps one Main at a time: it sets Stdout, Stderr and the flags.
var mainMu sync.Mutex

// cli runs gpushm with args: in this process, through Main, or as a
// process of its own where a file is "-" (put and get copy through the
// process's standard input and output, not Stdout), stdin is given, or
// the command is the daemon (whose serving process says why it failed on
// its own standard error).
func cli(t *testing.T, stdin []byte, args ...string) result {
	t.Helper()
	if stdin != nil || slices.Contains(args, "-") || slices.Contains(args, "daemon") {
		cmd := exec.Command(os.Args[0], args...)
		if stdin != nil {
			cmd.Stdin = bytes.NewReader(stdin)
		}
		return runCmd(t, cmd)
	}
	mainMu.Lock()
	defer mainMu.Unlock()
	var out, errb bytes.Buffer
	Stdout, Stderr = &out, &errb
	defer func() { Stdout, Stderr = os.Stdout, os.Stderr }()
	code := Main(args)
	return result{out.String(), errb.String(), code}
}

// runCmd runs cmd to its end (testutil.Run).
func runCmd(t *testing.T, cmd *exec.Cmd) result {
	t.Helper()
	stdout, stderr, code := testutil.Run(t, cmd)
	return result{stdout, stderr, code}
}

func mustRun(t *testing.T, stdin []byte, args ...string) string {
	t.Helper()
	r := cli(t, stdin, args...)
	if r.code != 0 {
		t.Fatalf("gpushm %v: exit %d: %s", args, r.code, r.stderr)
	}
	return r.stdout
}

// mustFail runs a command that must fail with an error (a line starting
// "gpushm: ", after any notices) that mentions want.
func mustFail(t *testing.T, want string, args ...string) {
	t.Helper()
	r := cli(t, nil, args...)
	if r.code == 0 || !testutil.ErrorSays(r.stderr, want) {
		t.Fatalf("gpushm %v: exit %d, stderr %q; want failure mentioning %q", args, r.code, r.stderr, want)
	}
}

// cliDaemon starts a host daemon on a socket in a directory of its own and
// points the commands the test runs at it ($GPUSHM_SOCKET).
func cliDaemon(t *testing.T) (dir, sock string) {
	t.Helper()
	dir = testutil.SocketDir(t)
	sock = filepath.Join(dir, "gpushm.sock")
	startDaemonProc(t, sock)
	t.Setenv("GPUSHM_SOCKET", sock)
	return dir, sock
}

// startDaemonProc runs 'gpushm daemon' as a separate process, for the
// commands to talk to: the daemon the CLI's users have. (integration/'s
// Start is the one that crashes and upgrades it.)
func startDaemonProc(t *testing.T, socket string, args ...string) *exec.Cmd {
	t.Helper()
	cmd := exec.Command(os.Args[0], append([]string{"daemon", "--socket", socket, "--backend", "host"}, args...)...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		testutil.KillDaemon(socket, cmd)
		testutil.DumpDaemonLog(t, stderr.String())
	})
	for i := 0; ; i++ {
		if cli(t, nil, "--socket", socket, "info").code == 0 {
			return cmd
		}
		if i > 500 {
			t.Fatalf("daemon never answered on %s: %s", socket, stderr.String())
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestCLI(t *testing.T) {
	dir := testutil.SocketDir(t)
	sock := filepath.Join(dir, "run", "gpushm.sock")
	daemon := startDaemonProc(t, sock)
	t.Setenv("GPUSHM_SOCKET", sock) // every command below finds it this way

	mustFail(t, "already running", "daemon", "--socket", sock, "--backend", "host")

	if out := mustRun(t, nil, "create", "a", "64MiB", "--meta", `{"dtype":"f32"}`, "--mode", "0640"); !strings.Contains(out, "created a: 64 MiB") {
		t.Fatalf("create said %q", out)
	}
	mustFail(t, "exists", "create", "a", "1")
	if out := mustRun(t, nil, "create", "a", "64M", "--exist-ok"); !strings.Contains(out, "exists: a") {
		t.Fatalf("create --exist-ok said %q", out)
	}
	mustFail(t, "invalid size", "create", "b", "12XB")
	mustFail(t, "invalid name", "create", "x/y", "1")
	mustFail(t, "must be positive", "create", "z", "0")
	mustFail(t, "exceeds device", "create", "z", "1000T")

	out := mustRun(t, nil, "ls")
	if !strings.Contains(out, "NAME") || !strings.Contains(out, "a     64 MiB") || !strings.Contains(out, "0640") {
		t.Fatalf("ls:\n%s", out)
	}
	out = mustRun(t, nil, "stat", "a")
	for _, want := range []string{"size:        67108864", "mode:        0640", `meta:        {"dtype":"f32"}`, "handle:      memfd"} {
		if !strings.Contains(out, want) {
			t.Fatalf("stat lacks %q:\n%s", want, out)
		}
	}
	mustFail(t, "no such segment", "stat", "nope")

	// put/get through files and pipes, odd sizes.
	for _, size := range []int{1, 4095, 5<<20 + 3} {
		data := make([]byte, size)
		rand.NewChaCha8([32]byte{byte(size)}).Read(data)
		in := filepath.Join(dir, "in")
		os.WriteFile(in, data, 0o644)
		mustRun(t, nil, "put", "f", in)
		outPath := filepath.Join(dir, "out")
		mustRun(t, nil, "get", "f", outPath)
		got, _ := os.ReadFile(outPath)
		if sha256.Sum256(got) != sha256.Sum256(data) {
			t.Fatalf("put/get of %d bytes through files changed the data", size)
		}
		mustRun(t, data, "put", "p", "-")
		if got := mustRun(t, nil, "get", "p", "-"); got != string(data) {
			t.Fatalf("put/get of %d bytes through pipes changed the data (%d bytes back)", size, len(got))
		}
		mustRun(t, nil, "rm", "f", "p")
	}
	empty := filepath.Join(dir, "empty")
	os.WriteFile(empty, nil, 0o644)
	mustRun(t, nil, "put", "e", empty) // an empty segment (TestEmptyFiles)
	mustRun(t, nil, "rm", "e")
	mustFail(t, "exists", "put", "a", filepath.Join(dir, "in"))
	mustFail(t, "no such file", "put", "e", filepath.Join(dir, "missing"))

	if out := mustRun(t, nil, "info"); !strings.Contains(out, "backend:  host") || !strings.Contains(out, "1 named") {
		t.Fatalf("info:\n%s", out)
	}
	mustRun(t, nil, "rm", "a")
	mustFail(t, "no such segment", "rm", "a")
	mustRun(t, nil, "rm", "-f", "a")
	if out := mustRun(t, nil, "info"); !strings.Contains(out, "0 named, 0 holding memory") {
		t.Fatalf("info after rm:\n%s", out)
	}

	// SIGTERM: clean exit, socket removed.
	daemon.Process.Signal(syscall.SIGTERM)
	if err := daemon.Wait(); err != nil {
		t.Fatalf("daemon exit after SIGTERM: %v", err)
	}
	if _, err := os.Stat(sock); !os.IsNotExist(err) {
		t.Fatalf("socket still there after SIGTERM: %v", err)
	}
	mustFail(t, "is 'gpushm daemon' running?", "ls")
}

func TestHelp(t *testing.T) {
	out := mustRun(t, nil, "--help")
	for _, cmd := range []string{"daemon", "create", "ls", "stat", "rm", "put", "get", "info", "bench", "demo"} {
		if !strings.Contains(out, "  "+cmd) {
			t.Errorf("--help does not list %s", cmd)
		}
	}
	if strings.Contains(out, "__child") {
		t.Error("--help lists the hidden __child command")
	}
}

func TestParseSize(t *testing.T) {
	tests := []struct {
		in   string
		want int64
		ok   bool
	}{
		{"4096", 4096, true},
		{"64MiB", 64 << 20, true},
		{"64M", 64 << 20, true},
		{"1G", 1 << 30, true},
		{"1g", 1 << 30, true},
		{"1GB", 1e9, true},
		{"1.5K", 1536, true},
		{"2 TiB", 2 << 40, true},
		{"", 0, false},
		{"MiB", 0, false},
		{"12XB", 0, false},
		{"-1", 0, false},
		{"99999999999T", 0, false},
	}
	for _, tc := range tests {
		got, err := bytesize.Parse(tc.in)
		if (err == nil) != tc.ok || got != tc.want {
			t.Errorf("bytesize.Parse(%q) = %d, %v; want %d, ok=%v", tc.in, got, err, tc.want, tc.ok)
		}
	}
}

func TestQuotaFlagsAndLifetimes(t *testing.T) {
	sock := filepath.Join(testutil.SocketDir(t), "gpushm.sock")
	startDaemonProc(t, sock, "--max-memory", "1%", "--user-quota", "1M", "--user-segments", "10")
	t.Setenv("GPUSHM_SOCKET", sock)
	mustRun(t, nil, "create", "t", "4K", "--ttl", "10m")
	out := mustRun(t, nil, "ls")
	if !strings.Contains(out, "LIFETIME") || !strings.Contains(out, "ttl 10m0s (") {
		t.Fatalf("ls does not show the TTL:\n%s", out)
	}
	if out := mustRun(t, nil, "stat", "t"); !strings.Contains(out, "lifetime:    ttl 10m0s") {
		t.Fatalf("stat does not show the TTL:\n%s", out)
	}
	// Root is exempt from user quotas, not from the device share: 2% of
	// this machine's memory is more than its 1%.
	mustRun(t, nil, "create", "over-user-quota", "2M")
	mustFail(t, "quota exceeded", "create", "bigger", strconv.FormatInt(testutil.MemTotal(t)/50, 10))
	mustFail(t, "want a share between", "daemon", "--socket", sock+"2", "--backend", "host", "--max-memory", "150%")
	mustFail(t, "leave fewer than", "daemon", "--socket", sock+"2", "--backend", "host", "--max-segments", "1000000000", "--max-connections", "1")
	mustFail(t, "--user-connections \"x\": want a number", "daemon", "--socket", sock+"2", "--backend", "host", "--user-connections", "x")
	mustRun(t, nil, "chmod", "0644", "t")
	mustRun(t, nil, "chown", "65534:65534", "t")
	mustRun(t, nil, "mv", "t", "u")
	out = mustRun(t, nil, "stat", "u")
	if !strings.Contains(out, "mode:        0644") || !strings.Contains(out, "(65534:65534)") {
		t.Fatalf("stat after chmod, chown, mv:\n%s", out)
	}
	mustFail(t, "mode \"9\"", "chmod", "9", "u")
	mustFail(t, "no such segment", "chmod", "0600", "t")
	// Symbolic modes, against the mode the segment has (0644).
	for _, step := range []struct{ mode, want string }{{"g+w", "0664"}, {"a-w", "0444"}, {"u=rw,go=", "0600"}, {"o=u", "0606"}} {
		mustRun(t, nil, "chmod", step.mode, "u")
		if out := mustRun(t, nil, "stat", "u"); !strings.Contains(out, "mode:        "+step.want) {
			t.Fatalf("after chmod %s: want mode %s:\n%s", step.mode, step.want, out)
		}
	}
	mustFail(t, "no 's' bit", "chmod", "u+s", "u")
	mustFail(t, "no such segment", "chmod", "g+r", "t")
}
