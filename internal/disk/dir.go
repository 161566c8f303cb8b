package disk

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// A dir is one directory of a store. fd is held from Open to Close and
// every file is opened relative to it, without following a symbolic link,
// so that a path swapped after Open reaches nothing else.
type dir struct {
	path     string
	fd       int
	dev, ino uint64
	id       dirID
	align    int64
	direct   bool
	lanes    chan *lane // the directory's staging buffers, one lane per stream
}

// openDir opens and checks one directory (Open says what is checked).
func openDir(path string, log *slog.Logger) (*dir, error) {
	path = filepath.Clean(path)
	if err := os.Mkdir(path, 0o700); err == nil {
		log.Info("disk: made directory", "dir", path)
	} else if !errors.Is(err, fs.ErrExist) {
		return nil, fmt.Errorf("disk: directory %s: %w (its parent must exist)", path, err)
	}
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		if errors.Is(err, unix.ELOOP) || errors.Is(err, unix.ENOTDIR) {
			return nil, fmt.Errorf("disk: %s is not a directory (a symbolic link is refused: give the directory it points to): %w", path, err)
		}
		return nil, fmt.Errorf("disk: directory %s: %w", path, err)
	}
	d := &dir{path: path, fd: fd}
	if err := d.check(log); err != nil {
		d.close()
		return nil, err
	}
	return d, nil
}

// ready locks the directory against other stores, checks it takes writes,
// and reads or makes its id.
func (d *dir) ready(buffered bool) error {
	if err := unix.Flock(d.fd, unix.LOCK_EX|unix.LOCK_NB); err != nil {
		return fmt.Errorf("disk: directory %s is in use by another store (another daemon?): %w", d.path, err)
	}
	if err := d.probe(buffered); err != nil {
		return err
	}
	return d.readID()
}

// check holds the directory to its trust rules: ours, and writable by
// nobody else; readable by others is narrowed to 0700.
func (d *dir) check(log *slog.Logger) error {
	var st unix.Stat_t
	if err := unix.Fstat(d.fd, &st); err != nil {
		return fmt.Errorf("disk: directory %s: %w", d.path, err)
	}
	d.dev, d.ino = uint64(st.Dev), uint64(st.Ino)
	if uid := os.Geteuid(); int(st.Uid) != uid {
		return fmt.Errorf("disk: directory %s is owned by uid %d, not this daemon's (%d): refused; give a directory of the daemon's own", d.path, st.Uid, uid)
	}
	mode := st.Mode & 0o7777
	if mode&0o022 != 0 {
		return fmt.Errorf("disk: directory %s is writable by others (mode %04o): refused, since they could have planted files; chmod 700 it, or give another", d.path, mode)
	}
	if mode != 0o700 {
		if err := unix.Fchmod(d.fd, 0o700); err != nil {
			return fmt.Errorf("disk: directory %s: narrow mode %04o to 0700: %w", d.path, mode, err)
		}
		log.Info("disk: narrowed the directory's mode to 0700", "dir", d.path, "was", fmt.Sprintf("%04o", mode))
	}
	return nil
}

// probe writes, syncs and removes a file to see that the directory takes
// writes, and with O_DIRECT.
func (d *dir) probe(buffered bool) error {
	align, ok := directAlign(d.fd)
	d.align, d.direct = max(align, 4096), ok && !buffered && oDirect != 0
	buf, err := allocAligned(int(d.align))
	if err != nil {
		return err
	}
	defer freeAligned(buf)
	name := probePrefix + strconv.Itoa(os.Getpid()) + tmpExt
	for {
		err = d.probeOnce(name, buf)
		if err == nil || !d.direct || !directRefused(err) {
			break
		}
		d.direct = false
	}
	d.unlink(name)
	if err != nil {
		return fmt.Errorf("disk: directory %s does not take writes: %w", d.path, err)
	}
	return nil
}

func (d *dir) probeOnce(name string, buf []byte) error {
	fd, err := d.create(name)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	if err := pwriteFull(fd, buf, 0); err != nil {
		return err
	}
	return unix.Fsync(fd)
}

// readID reads the directory's id, or makes one: written aside, synced,
// renamed.
func (d *dir) readID() error {
	b, err := d.readFile(idFile, 128)
	if err == nil {
		s, ok := strings.CutPrefix(strings.TrimSpace(string(b)), "gpushm disk directory ")
		if n, err := hex.Decode(d.id[:], []byte(s)); !ok || err != nil || n != idLen || len(s) != 2*idLen {
			return fmt.Errorf("disk: %s: not a gpushm disk directory's id (%q): remove it to start afresh", filepath.Join(d.path, idFile), b)
		}
		return nil
	}
	if !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	rand.Read(d.id[:])
	if err := d.writeFile(idTmp, idFile, []byte("gpushm disk directory "+d.id.String()+"\n")); err != nil {
		return fmt.Errorf("disk: directory %s: write its id: %w", d.path, err)
	}
	return nil
}

// flags are those every open of a store's file has.
const flags = unix.O_NOFOLLOW | unix.O_CLOEXEC

// create makes a new file of the store's, 0600, opened for writing, with
// O_DIRECT when the directory takes it.
func (d *dir) create(name string) (int, error) {
	fl := unix.O_WRONLY | unix.O_CREAT | unix.O_EXCL | flags
	if d.direct {
		fl |= oDirect
	}
	fd, err := unix.Openat(d.fd, name, fl, 0o600)
	if err != nil {
		return -1, &fs.PathError{Op: "create", Path: filepath.Join(d.path, name), Err: err}
	}
	return fd, nil
}

// open opens a file of the store's for reading (with O_DIRECT if direct),
// and checks it is a regular file of ours: never a link, nor another's.
func (d *dir) open(name string, direct bool) (int, int64, error) {
	fl := unix.O_RDONLY | flags
	if direct {
		fl |= oDirect
	}
	path := filepath.Join(d.path, name)
	fd, err := unix.Openat(d.fd, name, fl, 0)
	if err != nil {
		return -1, 0, &fs.PathError{Op: "open", Path: path, Err: err}
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		unix.Close(fd)
		return -1, 0, &fs.PathError{Op: "stat", Path: path, Err: err}
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG || int(st.Uid) != os.Geteuid() {
		unix.Close(fd)
		return -1, 0, fmt.Errorf("%s: not a regular file of uid %d (mode %o, uid %d): %w", path, os.Geteuid(), st.Mode, st.Uid, ErrCorrupt)
	}
	return fd, st.Size, nil
}

// readFile reads a small file of the store's, of at most limit bytes.
func (d *dir) readFile(name string, limit int64) ([]byte, error) {
	fd, size, err := d.open(name, false)
	if err != nil {
		return nil, err
	}
	defer unix.Close(fd)
	if size > limit {
		return nil, fmt.Errorf("%s: %d bytes, more than %d: %w", filepath.Join(d.path, name), size, limit, ErrCorrupt)
	}
	b := make([]byte, size)
	n, err := unix.Pread(fd, b, 0)
	if err != nil {
		return nil, &fs.PathError{Op: "read", Path: filepath.Join(d.path, name), Err: err}
	}
	return b[:n], nil
}

// writeFile writes b to a new file tmp, syncs it, renames it to name and
// syncs the directory: name then holds b, or what it held before, whenever
// the machine stops.
func (d *dir) writeFile(tmp, name string, b []byte) error {
	d.unlink(tmp) // one a crash left
	fd, err := unix.Openat(d.fd, tmp, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|flags, 0o600)
	if err != nil {
		return &fs.PathError{Op: "create", Path: filepath.Join(d.path, tmp), Err: err}
	}
	err = pwriteFull(fd, b, 0)
	if err == nil {
		err = unix.Fsync(fd)
	}
	unix.Close(fd)
	if err == nil {
		err = unix.Renameat(d.fd, tmp, d.fd, name)
	}
	if err == nil {
		return d.sync()
	}
	d.unlink(tmp)
	return &fs.PathError{Op: "write", Path: filepath.Join(d.path, name), Err: err}
}

func (d *dir) unlink(name string) error {
	if err := unix.Unlinkat(d.fd, name, 0); err != nil {
		return &fs.PathError{Op: "remove", Path: filepath.Join(d.path, name), Err: err}
	}
	return nil
}

// sync makes the directory's entries durable: files made, renamed and
// removed.
func (d *dir) sync() error {
	if err := unix.Fsync(d.fd); err != nil {
		return &fs.PathError{Op: "sync", Path: d.path, Err: err}
	}
	return nil
}

// names lists the directory.
func (d *dir) names() ([]string, error) {
	fd, err := unix.Openat(d.fd, ".", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &fs.PathError{Op: "open", Path: d.path, Err: err}
	}
	f := os.NewFile(uintptr(fd), d.path)
	defer f.Close()
	return f.Readdirnames(-1)
}

// regular says whether name is a regular file of ours, without following
// a link.
func (d *dir) regular(name string) bool {
	var st unix.Stat_t
	err := unix.Fstatat(d.fd, name, &st, unix.AT_SYMLINK_NOFOLLOW)
	return err == nil && st.Mode&unix.S_IFMT == unix.S_IFREG && int(st.Uid) == os.Geteuid()
}

// close releases the directory, its lock and its staging buffers.
func (d *dir) close() error {
	if d.lanes != nil {
		close(d.lanes)
		for l := range d.lanes {
			l.free()
		}
		d.lanes = nil
	}
	if d.fd < 0 {
		return nil
	}
	err := unix.Close(d.fd)
	d.fd = -1
	return err
}

// pwriteFull writes all of b at off.
func pwriteFull(fd int, b []byte, off int64) error {
	for len(b) > 0 {
		n, err := unix.Pwrite(fd, b, off)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return err
		}
		if n == 0 {
			return unix.EIO
		}
		b, off = b[n:], off+int64(n)
	}
	return nil
}

// preadFull fills b from off, and says how many bytes it read: fewer at
// the end of the file.
func preadFull(fd int, b []byte, off int64) (int, error) {
	got := 0
	for got < len(b) {
		n, err := unix.Pread(fd, b[got:], off+int64(got))
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return got, err
		}
		if n == 0 {
			break
		}
		got += n
	}
	return got, nil
}

// allocAligned returns page-aligned memory outside the Go heap, as
// O_DIRECT needs.
func allocAligned(n int) ([]byte, error) {
	b, err := unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return nil, fmt.Errorf("disk: staging buffer of %d bytes: %w", n, err)
	}
	return b, nil
}

func freeAligned(b []byte) { unix.Munmap(b) }
