package gpushm

import (
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/gpushm/gpushm/internal/wire"
)

// Finding the daemon: which socket a client dials when given none, and
// what it says when no candidate answers. Who the client accepts there is
// trust.go's business.

// SystemSocket is where a daemon run as root listens by default ('gpushm
// install-systemd', the Kubernetes DaemonSet): the node's daemon, which
// every local user may reach.
const SystemSocket = "/run/gpushm/gpushm.sock"

// systemSocket is SystemSocket; tests of the candidates point it
// elsewhere.
var systemSocket = SystemSocket

// DefaultSocket is where 'gpushm daemon' listens when given no socket:
// $GPUSHM_SOCKET, else the user's own socket: SystemSocket for root, else
// $XDG_RUNTIME_DIR/gpushm/gpushm.sock (or $TMPDIR/gpushm-UID/gpushm.sock,
// /tmp by default). Clients look in SocketCandidates.
func DefaultSocket() string {
	if p := os.Getenv("GPUSHM_SOCKET"); p != "" {
		return p
	}
	return userSocket()
}

// userSocket is the user's own socket, where a daemon the user runs
// listens by default.
func userSocket() string {
	euid := geteuid()
	if euid == 0 {
		return systemSocket
	}
	if d := os.Getenv("XDG_RUNTIME_DIR"); d != "" {
		return filepath.Join(d, "gpushm", "gpushm.sock")
	}
	return filepath.Join(os.TempDir(), fmt.Sprintf("gpushm-%d", euid), "gpushm.sock")
}

// SocketCandidates is where a client given no socket (Dial with "") looks
// for the daemon, in order: $GPUSHM_SOCKET alone when it is set; else the
// user's own socket (DefaultSocket: a daemon the user runs), then
// SystemSocket (the node's daemon, run as root). For root the two are one,
// tried once. Dial moves on to the next when nothing listens at a path (no
// such file, connection refused) or when a path found this way fails the
// checks of who owns it (docs/security.md, "Finding the daemon").
func SocketCandidates() []string {
	var paths []string
	for _, c := range candidates() {
		paths = append(paths, c.path)
	}
	return paths
}

// candidates is SocketCandidates with the origin of each.
func candidates() []candidate {
	if p := os.Getenv("GPUSHM_SOCKET"); p != "" {
		return []candidate{{p, given}}
	}
	own := userSocket()
	if own == systemSocket {
		return []candidate{{own, nodeSocket}}
	}
	return []candidate{{own, ownSocket}, {systemSocket, nodeSocket}}
}

// discover connects to the daemon at socket, or, with socket "", to the
// first of the candidates that answers, and says which it reached. Every
// attempt goes through dialConn, so that nothing is sent to a socket or a
// daemon that t refuses.
func discover(socket string, t trust, timeout time.Duration) (candidate, *wire.Conn, error) {
	if socket != "" {
		cand := candidate{socket, given}
		conn, err := dialConn(cand, t, timeout)
		var r *refusal
		if errors.As(err, &r) {
			return cand, nil, fmt.Errorf("gpushm: %w", err)
		}
		if err != nil {
			hint := "is 'gpushm daemon' running?"
			if denied(err) {
				hint = deniedHint
			}
			return cand, nil, fmt.Errorf("gpushm: cannot reach daemon at %s (%s): %w", socket, hint, err)
		}
		return cand, conn, nil
	}
	tried := unreachableError{fromEnv: os.Getenv("GPUSHM_SOCKET") != ""}
	for _, cand := range candidates() {
		conn, err := dialConn(cand, t, timeout)
		if err == nil {
			return cand, conn, nil
		}
		tried.paths, tried.errs = append(tried.paths, cand.path), append(tried.errs, err)
		if !nothingListens(err) && !errors.Is(err, ErrUntrusted) {
			// A daemon may be there: say so rather than reach another.
			break
		}
	}
	return candidate{}, nil, &tried
}

// nothingListens says whether err, from a dial, means that no daemon
// listens at the path (so the next candidate may be tried), rather than
// that one is there but cannot be used (permission denied, a timeout).
func nothingListens(err error) bool {
	return errors.Is(err, syscall.ENOENT) || errors.Is(err, syscall.ECONNREFUSED)
}

// unreachableError is Dial's error when no candidate socket answered: each
// path tried, with its dial error or why it was refused.
type unreachableError struct {
	paths   []string
	errs    []error
	fromEnv bool // the one path was $GPUSHM_SOCKET
}

func (e *unreachableError) Error() string {
	var b strings.Builder
	b.WriteString("gpushm: cannot reach a daemon: ")
	for i, p := range e.paths {
		if i > 0 {
			b.WriteString("; ")
		}
		var r *refusal
		if errors.As(e.errs[i], &r) {
			b.WriteString(r.Error())
			continue
		}
		b.WriteString(p + ": " + dialReason(e.errs[i]))
	}
	switch {
	case slices.ContainsFunc(e.errs, denied):
		b.WriteString(" (" + deniedHint + ")")
	case e.fromEnv:
		b.WriteString(" (is 'gpushm daemon' running? the path is $GPUSHM_SOCKET)")
	default:
		b.WriteString(" (is 'gpushm daemon' running? set $GPUSHM_SOCKET to choose a socket)")
	}
	return b.String()
}

// denied says whether err, a dial's, is a socket there that refused this
// user (permission denied), rather than one absent or unanswered.
func denied(err error) bool {
	return errors.Is(err, syscall.EACCES) || errors.Is(err, syscall.EPERM)
}

// deniedHint says what to look at when a socket refused this user.
const deniedHint = "a daemon's socket is there, but this user may not connect: its group and mode say who may, as 'ls -l' shows; see 'gpushm daemon --socket-group'"

func (e *unreachableError) Unwrap() []error { return e.errs }

// dialReason is err, from a dial, without the path it repeats.
func dialReason(err error) string {
	var op *net.OpError
	if errors.As(err, &op) {
		err = op.Err
	}
	var sc *os.SyscallError
	if errors.As(err, &sc) {
		err = sc.Err
	}
	var pe *fs.PathError
	if errors.As(err, &pe) {
		err = pe.Err
	}
	if errors.Is(err, syscall.ENOENT) {
		return "no such file"
	}
	return err.Error()
}
