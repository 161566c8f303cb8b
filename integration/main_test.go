// Package integration tests the daemon as users run it: 'gpushm daemon'
// processes (a supervisor and its serving process) that are crashed,
// upgraded, restarted under systemd, squeezed by other users and filled
// past their tiers, with clients that are processes of their own.
//
// The tests run a gpushm binary: $GPUSHM_BIN if set, else one TestMain
// builds from ./cmd/gpushm. Every daemon is started by Start
// (launch_test.go); the clients that are not the CLI are this test binary
// again, in one of the roles of the table below. The files are named by
// what they test: survive_*_test.go (crashes, upgrades, the supervisor),
// systemd_test.go, tiers_test.go, hostile_test.go, neighbours_test.go,
// fairshare_test.go, fuse_test.go, ...
package integration

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/gpushm/gpushm/internal/testutil"
)

// gpushmBin is the gpushm binary the tests run.
var gpushmBin string

// roles are the clients this test binary plays when the test that starts
// it sets the role's variable: the value is the role's argument, and a
// failure is said on standard error (standard output for pidns, which its
// test reads) with the exit status 1.
var roles = []struct {
	env, what string
	main      func(arg string) error
}{
	{"GPUSHM_TEST_CHANS", "channel", chansMain},
	{"GPUSHM_TEST_WRITER", "writer", writerMain},
	{"GPUSHM_TEST_NEIGHBOUR", "client as another uid", func(uid string) error {
		n, _ := strconv.Atoi(uid)
		return neighbourMain(n)
	}},
	{"GPUSHM_TEST_HOLDER", "holder", func(string) error { return holderMain() }},
	{"GPUSHM_TEST_IDLE", "idle client", idleMain},
	{"GPUSHM_TEST_TIERS", "tiers client", func(string) error { return tiersMain() }},
	{"GPUSHM_TEST_CHAOS", "chaos client", func(k string) error {
		n, _ := strconv.Atoi(k)
		return chaosClientMain(n)
	}},
	{"GPUSHM_TEST_PIDNS", "pid namespace", pidnsMain},
	{"GPUSHM_TEST_PASSCONN", "passing a connection", passConnMain},
}

func TestMain(m *testing.M) {
	for _, r := range roles {
		arg := os.Getenv(r.env)
		if arg == "" {
			continue
		}
		gpushmBin = os.Getenv("GPUSHM_BIN")
		if err := r.main(arg); err != nil {
			if r.env == "GPUSHM_TEST_PIDNS" {
				fmt.Printf("fail: %v\n", err)
			} else {
				fmt.Fprintf(os.Stderr, "%s %s: %v\n", r.what, arg, err)
			}
			os.Exit(1)
		}
		os.Exit(0)
	}
	if len(os.Args) > 1 && !strings.HasPrefix(os.Args[1], "-") {
		// Run as gpushm (os.Executable of a test, say): that is
		// $GPUSHM_BIN, not the tests again.
		fmt.Fprintf(os.Stderr, "integration.test %s: this is not gpushm (run %s)\n", strings.Join(os.Args[1:], " "), os.Getenv("GPUSHM_BIN"))
		os.Exit(2)
	}
	os.Exit(run(m))
}

// run builds the gpushm binary, unless $GPUSHM_BIN names one, and runs the
// tests; the roles find the binary in $GPUSHM_BIN too.
func run(m *testing.M) int {
	gpushmBin = os.Getenv("GPUSHM_BIN")
	if gpushmBin == "" {
		// Readable by every user: tests run it as others.
		dir, err := os.MkdirTemp("", "gpushm-integration-")
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		defer os.RemoveAll(dir)
		os.Chmod(dir, 0o755)
		gpushmBin = filepath.Join(dir, "gpushm")
		args := []string{"build", "-o", gpushmBin}
		if raceBuild {
			args = append(args, "-race")
		}
		build := exec.Command("go", append(args, "github.com/gpushm/gpushm/cmd/gpushm")...)
		build.Stdout, build.Stderr = os.Stderr, os.Stderr
		if err := build.Run(); err != nil {
			fmt.Fprintf(os.Stderr, "go build ./cmd/gpushm: %v\n", err)
			return 1
		}
	} else if abs, err := filepath.Abs(gpushmBin); err == nil {
		gpushmBin = abs
	}
	os.Setenv("GPUSHM_BIN", gpushmBin)
	return m.Run()
}

type result struct {
	stdout, stderr string
	code           int
}

// cli runs the gpushm binary with args, stdin on its standard input.
func cli(t *testing.T, stdin []byte, args ...string) result {
	t.Helper()
	cmd := exec.Command(gpushmBin, args...)
	if stdin != nil {
		cmd.Stdin = bytes.NewReader(stdin)
	}
	return runCmd(t, cmd)
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
