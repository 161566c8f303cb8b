package gpushm

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/gpushm/gpushm/internal/wire"
)

// Trusting the daemon: what a socket, and the daemon answering on it, must
// pass before the client sends anything there (docs/security.md, "Finding
// the daemon"). Every connection, the first and every reconnection, is
// made by dialConn, which checks both.

// origin is how a client came to a socket path, which decides what the
// path and the daemon answering on it must pass before the client sends
// anything there.
type origin int

const (
	// given: Dial's argument or $GPUSHM_SOCKET, the operator's choice.
	given origin = iota
	// ownSocket: the user's own socket, found by convention in a
	// directory anybody could have made first (/tmp).
	ownSocket
	// nodeSocket: SystemSocket, found by convention.
	nodeSocket
)

// candidate is a socket path and how the client came to it.
type candidate struct {
	path   string
	origin origin
}

// geteuid is os.Geteuid; tests of the candidates point it elsewhere.
var geteuid = os.Geteuid

// ErrUntrusted is matched (errors.Is) by Dial's error when a socket, or the
// daemon answering on it, failed the client's checks of who owns it: the
// client sent it nothing.
var ErrUntrusted = errors.New("gpushm: socket not trusted")

// refusal is a candidate the client will not talk to: what (a socket or
// its directory) and why.
type refusal struct {
	what, why string
}

func (r *refusal) Error() string        { return r.what + ": " + r.why }
func (r *refusal) Is(target error) bool { return target == ErrUntrusted }

// trust is who a client accepts as the owner of a socket and as the
// daemon answering on it: itself, root, and the node's dedicated daemon
// user if $GPUSHM_DAEMON_UID names one.
type trust struct {
	euid      int
	daemonUID int // $GPUSHM_DAEMON_UID, or -1
	// overflow is the uid an owner that this user namespace does not map
	// reads as (/proc/sys/kernel/overflowuid); rootUnmapped says that
	// root is one of them, so that the node's daemon reads as overflow.
	overflow     int
	rootUnmapped bool
}

// loadTrust reads who the client trusts, failing on a $GPUSHM_DAEMON_UID
// that is not a uid.
func loadTrust() (trust, error) {
	t := trust{euid: geteuid(), daemonUID: -1, overflow: 65534}
	if v := os.Getenv("GPUSHM_DAEMON_UID"); v != "" {
		n, err := strconv.ParseUint(v, 10, 31)
		if err != nil {
			return t, fmt.Errorf("gpushm: GPUSHM_DAEMON_UID=%q is not a uid: set it to the node daemon's numeric uid, or unset it", v)
		}
		t.daemonUID = int(n)
	}
	if b, err := os.ReadFile("/proc/sys/kernel/overflowuid"); err == nil {
		if n, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil {
			t.overflow = n
		}
	}
	if b, err := os.ReadFile("/proc/self/uid_map"); err == nil {
		t.rootUnmapped = !mapsRoot(string(b))
	}
	return t, nil
}

// mapsRoot says whether a uid_map maps the outer uid 0 into this user
// namespace.
func mapsRoot(uidMap string) bool {
	for _, line := range strings.Split(uidMap, "\n") {
		f := strings.Fields(line)
		if len(f) != 3 {
			continue
		}
		outer, err1 := strconv.ParseUint(f[1], 10, 32)
		count, err2 := strconv.ParseUint(f[2], 10, 32)
		if err1 == nil && err2 == nil && outer == 0 && count > 0 {
			return true
		}
	}
	return false
}

// trusted says whether uid may own the node's socket directory, or be the
// daemon: the caller, root, or the dedicated daemon user.
func (t trust) trusted(uid int) bool {
	return uid == t.euid || uid == 0 || (t.daemonUID >= 0 && uid == t.daemonUID)
}

// unmappedRoot says whether uid may be root's, unmapped in this user
// namespace: it may as well be any other user the namespace does not map.
func (t trust) unmappedRoot(uid int) bool {
	return t.rootUnmapped && uid == t.overflow
}

// checkPath refuses a socket found by convention whose directory (or, for
// the user's own, the socket itself) another user could have made or
// could replace, as ssh-agent and tmux check theirs. A path given
// explicitly is the operator's choice, not checked here. Errors other than
// a *refusal are lstat's (no such file: nothing listens there).
func (t trust) checkPath(c candidate) error {
	switch c.origin {
	case ownSocket:
		if err := t.checkOwnDir(filepath.Dir(c.path)); err != nil {
			return err
		}
		return t.checkOwnSocket(c.path)
	case nodeSocket:
		return t.checkNodeDir(c)
	}
	return nil
}

// checkOwnDir checks the directory of the user's own socket: a real
// directory (not a symbolic link), the caller's, writable by nobody else.
func (t trust) checkOwnDir(dir string) error {
	fi, err := os.Lstat(dir)
	if err != nil {
		return err
	}
	switch {
	case fi.Mode()&fs.ModeSymlink != 0:
		return &refusal{dir, "a symbolic link, not a directory: skipped (another user may have made it)"}
	case !fi.IsDir():
		return &refusal{dir, "not a directory: skipped"}
	}
	if uid := int(fi.Sys().(*syscall.Stat_t).Uid); uid != t.euid {
		return &refusal{dir, fmt.Sprintf("owned by uid %d, not you: skipped (another user may have made it)", uid)}
	}
	if fi.Mode().Perm()&0o022 != 0 {
		return &refusal{dir, fmt.Sprintf("mode %04o lets group or others replace the socket: skipped (chmod go-w %s)", fi.Mode().Perm(), dir)}
	}
	return nil
}

// checkOwnSocket checks the user's own socket: a socket (not a symbolic
// link), the caller's or root's.
func (t trust) checkOwnSocket(path string) error {
	fi, err := os.Lstat(path)
	if err != nil {
		return err
	}
	if fi.Mode().Type() != fs.ModeSocket {
		return &refusal{path, "not a socket: skipped"}
	}
	if uid := int(fi.Sys().(*syscall.Stat_t).Uid); uid != t.euid && uid != 0 {
		return &refusal{path, fmt.Sprintf("owned by uid %d, neither you nor root: skipped (another user may have put it there)", uid)}
	}
	return nil
}

// checkNodeDir checks the directory of the node's socket: root's (or the
// caller's, or the dedicated daemon user's), writable by nobody else. Only
// root may make a directory in /run, so a symbolic link there is root's
// and is followed.
func (t trust) checkNodeDir(c candidate) error {
	dir := filepath.Dir(c.path)
	fi, err := os.Stat(dir)
	if err != nil {
		return err
	}
	if !fi.IsDir() {
		return &refusal{dir, "not a directory: skipped"}
	}
	uid := int(fi.Sys().(*syscall.Stat_t).Uid)
	switch {
	case t.unmappedRoot(uid):
		return &refusal{dir, fmt.Sprintf("owned by uid %d, the overflow uid: root's, or any user this user namespace does not map: skipped (set GPUSHM_SOCKET=%s to trust it)", uid, c.path)}
	case !t.trusted(uid):
		return &refusal{dir, fmt.Sprintf("owned by uid %d, neither root nor you: skipped (another user may have made it; set GPUSHM_DAEMON_UID=%d if that user runs the node's daemon)", uid, uid)}
	case fi.Mode().Perm()&0o022 != 0:
		return &refusal{dir, fmt.Sprintf("mode %04o lets group or others replace the socket: skipped (chmod go-w %s)", fi.Mode().Perm(), dir)}
	}
	return nil
}

// checkPeer refuses a daemon that answered on c as neither the caller,
// root, nor the dedicated daemon user, before anything is sent to it. In
// a user namespace that does not map root, the node's daemon reads as the
// overflow uid, as does any other user the namespace does not map: it is
// accepted only on a path given explicitly, whose trust is then the
// operator's (who mounted it there).
func (t trust) checkPeer(c candidate, uid int) error {
	switch {
	case t.trusted(uid):
		return nil
	case t.unmappedRoot(uid) && c.origin == given:
		return nil
	case t.unmappedRoot(uid):
		return &refusal{c.path, fmt.Sprintf("the daemon answering reads as uid %d, the overflow uid: root's, or any user this user namespace does not map: refused, nothing sent (set GPUSHM_SOCKET=%s to trust it)", uid, c.path)}
	}
	return &refusal{c.path, fmt.Sprintf("the daemon answering runs as uid %d, neither you (uid %d) nor root: refused, nothing sent (another user may run it; set GPUSHM_DAEMON_UID=%d if that user runs the node's daemon)", uid, t.euid, uid)}
}

// dialConn connects to the daemon at c, with the client's spin: every
// connection, the first and every reconnection, comes here, so that none
// sends a byte to a socket or a daemon that t does not trust.
func dialConn(c candidate, t trust, timeout time.Duration) (*wire.Conn, error) {
	if err := t.checkPath(c); err != nil {
		return nil, err
	}
	conn, err := wire.DialTimeout(c.path, timeout)
	if err != nil {
		return nil, err
	}
	cred, err := conn.PeerCred()
	if err == nil {
		err = t.checkPeer(c, int(cred.UID))
	}
	if err != nil {
		conn.Close()
		return nil, err
	}
	conn.SetSpin(ClientSpin())
	return conn, nil
}
