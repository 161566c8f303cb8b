package fusefs

import (
	"bufio"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

// prepare makes dir ready to mount on: it creates it if missing, cleans a
// stale mount (the daemon that served it died, so stat fails with
// ENOTCONN), and refuses a live gpushm mount.
func prepare(dir string, log *slog.Logger) error {
	_, err := os.Stat(dir)
	if errors.Is(err, syscall.ENOTCONN) || errors.Is(err, syscall.ECONNABORTED) {
		log.Warn("cleaning a stale FUSE mount left by a daemon that died", "dir", dir)
		if err := lazyUnmount(dir); err != nil {
			return fmt.Errorf("%s is a stale FUSE mount, and unmounting it failed: %w (try 'fusermount3 -u -z %s')", dir, err, dir)
		}
		_, err = os.Stat(dir)
	}
	switch {
	case errors.Is(err, fs.ErrNotExist):
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return fmt.Errorf("create mount point: %w", err)
		}
	case err != nil:
		return fmt.Errorf("mount point: %w", err)
	}
	fstype, err := mountedType(dir)
	if err != nil {
		return err
	}
	if fstype == "fuse.gpushm" {
		return fmt.Errorf("a gpushm view is already mounted at %s (is another daemon serving it? 'fusermount3 -u %s' if not)", dir, dir)
	}
	return nil
}

// lazyUnmount detaches the mount at dir: directly as root, else through
// fusermount.
func lazyUnmount(dir string) error {
	err := unix.Unmount(dir, unix.MNT_DETACH)
	if err == nil || !errors.Is(err, syscall.EPERM) {
		return err
	}
	for _, bin := range []string{"fusermount3", "fusermount"} {
		path, lerr := exec.LookPath(bin)
		if lerr != nil {
			continue
		}
		out, cerr := exec.Command(path, "-u", "-z", dir).CombinedOutput()
		if cerr != nil {
			return fmt.Errorf("%s -u -z: %v: %s", bin, cerr, strings.TrimSpace(string(out)))
		}
		return nil
	}
	return fmt.Errorf("%w, and no fusermount3 or fusermount is installed", err)
}

// mountedType is the file system type mounted exactly at dir ("" if dir is
// not a mount point), from /proc/self/mountinfo.
func mountedType(dir string) (string, error) {
	abs, err := filepath.Abs(dir)
	if err != nil {
		return "", err
	}
	if real, err := filepath.EvalSymlinks(abs); err == nil {
		abs = real
	}
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return "", fmt.Errorf("read mount table: %w", err)
	}
	defer f.Close()
	fstype := ""
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		// id parent major:minor root mountpoint options [optional...] - type source super
		fields := strings.Fields(sc.Text())
		if len(fields) < 5 || unescapeMount(fields[4]) != abs {
			continue
		}
		for i, f := range fields {
			if f == "-" && i+1 < len(fields) {
				// Later lines are mounted on top of earlier ones.
				fstype = fields[i+1]
			}
		}
	}
	return fstype, sc.Err()
}

// unescapeMount undoes the octal escapes (\040 for a space) of mountinfo.
func unescapeMount(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if v, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}
