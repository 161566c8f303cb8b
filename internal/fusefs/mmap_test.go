package fusefs_test

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

func TestMain(m *testing.M) {
	if os.Getenv("FUSEFS_MMAP_CHILD") != "" {
		if err := mmapChild(); err != nil {
			fmt.Fprintln(os.Stderr, "mmap child:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// mmapChild maps the file PATH shared and writes DATA (hex) at OFF, then
// unmaps (the kernel writes the page back); or, with READ=n, prints n
// bytes at OFF in hex. With ENODEV_OK, a file the kernel will not map
// (opened for direct I/O, before Linux 6.6) prints "enodev" instead.
// A test maps a file of the view only in a child: a fault on the mount in
// the process that serves it can wait for a server goroutine that waits,
// in turn, for the faulting thread to stop for the garbage collector.
func mmapChild() error {
	path := os.Getenv("PATH_TO_MAP")
	off, _ := strconv.Atoi(os.Getenv("OFF"))
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return err
	}
	b, err := unix.Mmap(int(f.Fd()), 0, int(st.Size()), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if errors.Is(err, unix.ENODEV) && os.Getenv("ENODEV_OK") != "" {
		fmt.Print("enodev")
		return nil
	}
	if err != nil {
		return fmt.Errorf("mmap %s: %w", path, err)
	}
	if n := os.Getenv("READ"); n != "" {
		k, _ := strconv.Atoi(n)
		fmt.Print(hex.EncodeToString(b[off : off+k]))
		return unix.Munmap(b)
	}
	data, err := hex.DecodeString(os.Getenv("DATA"))
	if err != nil {
		return err
	}
	copy(b[off:], data)
	if os.Getenv("MSYNC") != "" {
		if err := unix.Msync(b, unix.MS_SYNC); err != nil {
			return fmt.Errorf("msync: %w", err)
		}
	}
	return unix.Munmap(b)
}

func runMmapChild(t *testing.T, env ...string) string {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), append([]string{"FUSEFS_MMAP_CHILD=1"}, env...)...)
	cmd.Stderr = os.Stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("mmap child %v: %v", env, err)
	}
	return strings.TrimSpace(string(out))
}

// TestMmap: a second process maps a segment's file and writes; a socket
// client that opens the segment by name sees the bytes, after msync and
// after munmap alone; and the reverse, a client's write seen by a process
// that maps the file afterwards.
func TestMmap(t *testing.T) {
	forEachBackend(t, func(t *testing.T, e *env) {
		ctx := context.Background()
		const size = 3 << 20
		seg, err := e.c.Create(ctx, "mm", size, nil)
		if err != nil {
			t.Fatal(err)
		}
		seg.Close() // the lease goes; the segment stays, named
		path := e.path("mm")
		runMmapChild(t, "PATH_TO_MAP="+path, "OFF=1048570", "DATA="+hex.EncodeToString([]byte("across a page")), "MSYNC=1")
		runMmapChild(t, "PATH_TO_MAP="+path, "OFF=2097152", "DATA="+hex.EncodeToString([]byte("at munmap")))
		got := e.segmentBytes(t, "mm")
		if s := string(got[1048570 : 1048570+13]); s != "across a page" {
			t.Errorf("client reads %q where the mapping wrote and synced", s)
		}
		if s := string(got[2097152 : 2097152+9]); s != "at munmap" {
			t.Errorf("client reads %q where the mapping wrote and unmapped", s)
		}

		c, err := e.c.Open(ctx, "mm", nil)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		cm, err := c.Map()
		if err != nil {
			t.Fatal(err)
		}
		// Over bytes an earlier mapping had in the page cache: a new open
		// of the file drops what the kernel kept.
		if _, err := cm.WriteAt([]byte("from the client"), 1048570); err != nil {
			t.Fatal(err)
		}
		out := runMmapChild(t, "PATH_TO_MAP="+path, "OFF=1048570", "READ=15")
		if b, _ := hex.DecodeString(out); string(b) != "from the client" {
			t.Errorf("a mapping made after the client's write reads %q", b)
		}
	})
}
