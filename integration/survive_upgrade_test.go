package integration

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gpushm/gpushm/internal/testutil"
)

// Upgrades: a new binary on disk, SIGHUP, and nothing lost.

// TestUpgradeUnderLoad replaces the binary on disk and sends SIGHUP while
// clients work: each upgrade starts the new binary as the serving process,
// which takes over every connection, so no client sees an error or even a
// reconnection.
func TestSurviveUpgrade(t *testing.T) {
	upgrades := 10
	if testing.Short() {
		upgrades = 3
	}
	dir := testutil.SocketDir(t)
	os.Chmod(dir, 0o755)
	exe := filepath.Join(dir, "gpushm")
	install := func() os.FileInfo {
		t.Helper()
		b, err := os.ReadFile(gpushmBin)
		if err != nil {
			t.Fatal(err)
		}
		// A new file renamed over the old, as package managers do: the
		// running processes keep the old inode.
		if err := os.WriteFile(exe+".new", b, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(exe+".new", exe); err != nil {
			t.Fatal(err)
		}
		st, err := os.Stat(exe)
		if err != nil {
			t.Fatal(err)
		}
		return st
	}
	install()
	sock := filepath.Join(dir, "gpushm.sock")
	d := Start(t, Options{Exe: exe, Socket: sock, Args: []string{"--grace", "1s"}})
	var clients []*chaosClient
	for k := range 8 {
		var extra []string
		if k == 2 && os.Getuid() == 0 {
			extra = append(extra, "CHAOS_UID=4242")
		}
		clients = append(clients, startChaosClient(t, sock, k, extra...))
	}
	askAll(t, clients, "verify")
	for i := range upgrades {
		time.Sleep(100 * time.Millisecond)
		before, err := d.info()
		if err != nil {
			t.Fatal(err)
		}
		st := install()
		d.cmd.Process.Signal(syscall.SIGHUP)
		after := d.waitServing(t, before.PID)
		exeNow, err := os.Stat(fmt.Sprintf("/proc/%d/exe", after.PID))
		if err != nil {
			t.Fatal(err)
		}
		if !os.SameFile(exeNow, st) {
			t.Fatalf("upgrade %d: the serving process %d does not run the binary now on disk", i, after.PID)
		}
		if after.Restarts != 0 {
			t.Fatalf("upgrade %d: %d restarts: an upgrade is not a crash", i, after.Restarts)
		}
		// The old one exits once it handed over.
		for deadline := time.Now().Add(10 * time.Second); ; {
			kids := children(d.cmd.Process.Pid)
			if slices.Equal(kids, []int{after.PID}) {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("upgrade %d: supervisor's children %v, want [%d]", i, kids, after.PID)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	askAll(t, clients, "verify")
	for k, line := range askAll(t, clients, "stop") {
		if !strings.HasSuffix(line, "reconnects=0") {
			t.Errorf("client %d: %s: a connection was dropped by an upgrade", k, line)
		}
	}
	for _, cc := range clients {
		if err := cc.cmd.Wait(); err != nil {
			t.Fatalf("client exit: %v\n%s", err, cc.errs.String())
		}
	}
	d.Stop(t)
	if _, err := os.Stat(sock); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("socket left after a clean stop: %v", err)
	}
}
