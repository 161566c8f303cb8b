package server_test

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"syscall"
	"testing"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/testutil"
)

// TestMain runs this binary as a test's client of another user when the
// test asked (GPUSHM_SERVER_TEST_CHILD), else the tests.
func TestMain(m *testing.M) {
	if os.Getenv("GPUSHM_SERVER_TEST_CHILD") == "quick" {
		if err := quickChild(); err != nil {
			fmt.Fprintln(os.Stderr, "client:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// quickChild dials $GPUSHM_SOCKET $CONNS times, asks twice back to back on
// each connection, says "ready", and holds the connections until its
// stdin closes.
func quickChild() error {
	ctx := context.Background()
	n, err := strconv.Atoi(os.Getenv("CONNS"))
	if err != nil {
		return err
	}
	for range n {
		c, err := gpushm.Dial(ctx, os.Getenv("GPUSHM_SOCKET"))
		if err != nil {
			return err
		}
		defer c.Close()
		for range 2 {
			if _, err := c.Info(ctx); err != nil {
				return err
			}
		}
	}
	fmt.Println("ready")
	io.Copy(io.Discard, os.Stdin)
	return nil
}

// quickClientAs starts quickChild as uid (its own group), with conns
// connections to socket, and returns once they asked; they close when the
// test ends. It needs root.
func quickClientAs(t *testing.T, socket string, uid uint32, conns int) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("running clients as other users needs root")
	}
	cmd := exec.Command(testutil.BinaryForOthers(t), "-test.run=^$")
	cmd.Env = append(os.Environ(), "GPUSHM_SERVER_TEST_CHILD=quick", "GPUSHM_SOCKET="+socket, "CONNS="+strconv.Itoa(conns))
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uid, Gid: uid}}
	cmd.Stderr = os.Stderr
	in, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { in.Close(); cmd.Wait() })
	line, err := bufio.NewReader(out).ReadString('\n')
	if line != "ready\n" {
		t.Fatalf("client as uid %d: %q, %v", uid, line, err)
	}
}
