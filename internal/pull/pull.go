// Package pull moves a segment's bytes from a daemon on one node to a
// daemon on another over UCX (internal/ucx), in two helper processes the
// daemons exec: a lender that holds only the segment it lends, read-only,
// and a fetcher that holds only the segment it fills. UCX over tcp checks
// neither the key nor the range of a get or a put (docs/architecture.md,
// "Peers: the data path"), so neither daemon runs a worker itself, and the
// helpers run as an unprivileged user that cannot be traced: a peer that
// reaches a helper's port can read the one segment its owner offered, and
// at worst take over a process that holds nothing else.
//
// Beside the bytes a lender serves a board (board.go): how many chunks are
// ready and the CRC-32C of each. The fetcher reads it as it goes, so that
// a lender starts serving before it has read the whole segment, a GPU
// segment can be lent through a small ring of pinned buffers, and a node
// that is still fetching a segment can lend what it has so far to the next
// (a chain: fan-out at the cost of one transfer). The fetcher checks every
// chunk against the CRCs, so that a peer that sends wrong bytes, or a
// wrong size, is caught.
package pull

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/user"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Chunk is the unit of checksums, of gets and of a ring's slots.
const Chunk = 16 << 20

// ringSlots is a GPU lender's ring: pinned buffers of a Chunk each (128
// MiB), so that the copy from the GPU runs ahead of the wire.
const ringSlots = 8

// Grant is what a lender tells the fetcher, through the daemons' control
// plane: its worker's address, the address and key of what it lends and
// of its board, the size, the chunk, and the ring's slots (0: the segment
// is lent in place, chunk i at Addr + i*Chunk; else chunk i is at slot
// i % Ring while the board says it is staged).
type Grant struct {
	Worker   []byte `json:"worker"`
	Addr     uint64 `json:"addr"`
	RKey     []byte `json:"rkey"`
	Board    uint64 `json:"board"`
	BoardKey []byte `json:"board_key"`
	Size     int64  `json:"size"`
	Chunk    int64  `json:"chunk"`
	Ring     int    `json:"ring,omitempty"`
}

// chunks is how many chunks the grant's segment has.
func (g *Grant) chunks() int64 { return (g.Size + g.Chunk - 1) / g.Chunk }

// check says what is wrong with g for size bytes, or nil.
func (g *Grant) check(size int64) error {
	switch {
	case g.Size != size:
		return fmt.Errorf("the lender offers %d bytes, the segment has %d", g.Size, size)
	case g.Size <= 0:
		return fmt.Errorf("the lender offers %d bytes", g.Size)
	case g.Chunk != Chunk:
		// The sinks put chunk i at i*Chunk and the boards have room for
		// the checksums of Chunk-sized chunks: a lender's other chunk
		// would land its checked bytes elsewhere in the segment.
		return fmt.Errorf("a chunk of %d bytes, not %d", g.Chunk, Chunk)
	case g.Ring < 0 || g.Ring > 64:
		return fmt.Errorf("a ring of %d slots", g.Ring)
	case len(g.Worker) == 0 || len(g.RKey) == 0 || len(g.BoardKey) == 0:
		return errors.New("no worker address or key")
	}
	return nil
}

// Memory says what a helper's descriptor 3 is: host memory (a memfd; the
// zero Memory) or a CUDA allocation exported as a POSIX descriptor, of
// Alloc bytes (its size rounded to the device's granularity) on Device.
type Memory struct {
	CUDA   bool
	Device int
	Alloc  int64
}

// Host is host memory.
var Host = Memory{}

func (m Memory) args() []string {
	if !m.CUDA {
		return nil
	}
	return []string{"--device", strconv.Itoa(m.Device), "--alloc", strconv.FormatInt(m.Alloc, 10)}
}

// self is the gpushm binary the helpers run.
func self() string {
	if p, err := os.Executable(); err == nil {
		return p
	}
	return "/proc/self/exe"
}

// noPIDNamespace is set once a helper could not be started in a PID
// namespace of its own.
var noPIDNamespace atomic.Bool

// HelperUser is the user the helpers run as: UCX over tcp lets whoever
// reaches a helper's port write anywhere in its memory, so a helper must
// be worth nothing more than the one segment it was given. The daemon
// must be root to start them so; one that is not refuses to, unless
// HelperUser is empty, which keeps the daemon's user (a helper taken over
// is then the daemon's user, with its files and its descriptors through
// /proc: docs/peers.md).
var HelperUser = "nobody"

// helperIDs are the --uid and --gid arguments that make a helper drop to
// HelperUser, or none where HelperUser is empty.
func helperIDs() ([]string, error) {
	if HelperUser == "" {
		return nil, nil
	}
	if uid := os.Geteuid(); uid != 0 {
		return nil, fmt.Errorf("pull: the daemon runs as uid %d, not root, so its UCX helpers cannot run as %q, a user of their own; "+
			"run the daemon as root, or accept helpers that run as the daemon's user with --pull-helper-user '' (docs/peers.md, \"Trust\"): %w",
			uid, HelperUser, syscall.EPERM)
	}
	u, err := user.Lookup(HelperUser)
	if err != nil {
		return nil, fmt.Errorf("the helpers' user: %w", err)
	}
	uid, err1 := strconv.ParseUint(u.Uid, 10, 31)
	_, err2 := strconv.ParseUint(u.Gid, 10, 31)
	if err := errors.Join(err1, err2); err != nil || uid == 0 {
		return nil, fmt.Errorf("the helpers' user %q: uid %s, gid %s: not a user to run as", HelperUser, u.Uid, u.Gid)
	}
	return []string{"--uid", u.Uid, "--gid", u.Gid}, nil
}

// starts runs the helpers' starts on one thread, locked to its goroutine,
// which never ends: PR_SET_PDEATHSIG fires when the thread that started a
// helper ends, not the process, and the daemon ends threads of its own
// (the server's reapers, after a burst of connections any local user can
// make, return locked to whatever thread they ran on).
var (
	startOnce sync.Once
	starts    chan func()
)

func startLocked(cmd *exec.Cmd) error {
	startOnce.Do(func() {
		starts = make(chan func())
		go func() {
			runtime.LockOSThread()
			for f := range starts {
				f()
			}
		}()
	})
	done := make(chan error, 1)
	starts <- func() { done <- cmd.Start() }
	return <-done
}

// helper starts 'gpushm __pull VERB' with fds as its descriptors 3, 4, ...;
// the helper dies with the daemon (PR_SET_PDEATHSIG, from a thread that
// lasts as long as the process: startLocked; a helper that drops to
// HelperUser sets it again, since the kernel clears it as the helper's
// user changes), so a daemon killed leaves none behind. It starts as the
// daemon's user and drops to HelperUser first thing (harden): a binary
// root may run need not be one nobody may, and a process that was root
// until it dropped cannot be traced by the user it drops to.
func helper(verb string, m Memory, fds []int, args ...string) (*exec.Cmd, io.WriteCloser, *bufio.Reader, error) {
	ids, err := helperIDs()
	if err != nil {
		return nil, nil, nil, err
	}
	cmd := exec.Command(self(), append(append([]string{"__pull", verb}, ids...), args...)...)
	cmd.Args[0] = "gpushm-" + verb
	for _, fd := range fds {
		dup, err := syscall.Dup(fd)
		if err != nil {
			return nil, nil, nil, fmt.Errorf("dup: %w", err)
		}
		f := os.NewFile(uintptr(dup), "segment")
		defer f.Close()
		cmd.ExtraFiles = append(cmd.ExtraFiles, f)
	}
	cmd.Stderr = os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if len(ids) > 0 && !m.CUDA && !noPIDNamespace.Load() {
		// A process of its own PID namespace: whatever a helper taken
		// over forks dies with it, and holds its descriptors no longer.
		// Not for GPU memory: the CUDA driver does not start in one
		// (cuInit: CUDA_ERROR_OPERATING_SYSTEM on driver 580).
		cmd.SysProcAttr.Cloneflags = syscall.CLONE_NEWPID
	}
	in, err := cmd.StdinPipe()
	if err != nil {
		return nil, nil, nil, err
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, nil, nil, err
	}
	err = startLocked(cmd)
	if err != nil && cmd.SysProcAttr.Cloneflags != 0 && (errors.Is(err, syscall.EPERM) || errors.Is(err, syscall.EINVAL)) {
		// No new PID namespaces here (a container without CAP_SYS_ADMIN):
		// the helpers go without, as docs/peers.md says.
		noPIDNamespace.Store(true)
		return helper(verb, m, fds, args...)
	}
	if err != nil {
		return nil, nil, nil, fmt.Errorf("start the %s helper: %w", verb, err)
	}
	return cmd, in, bufio.NewReader(out), nil
}

// A Lender lends one segment until Close.
type Lender struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	Grant Grant
}

// StartTime bounds the wait for a lender's grant: past it the helper is
// killed and Lend fails; a fetcher is given as long to start, beside its
// stall times (Fetch). A helper runs as HelperUser, whose other processes
// may stop it (SIGSTOP), and the caller may hold locks meanwhile. A
// variable for tests.
var StartTime = time.Minute

// Lend starts a lender of size bytes of the memory fd (the helper gets a
// descriptor of its own; a read-only one is the caller's to give), and
// returns once it serves, with its Grant, or fails after StartTime. board,
// when not -1, is the board of a fetch still filling fd (a chain): the
// lender serves each chunk once that board says it is there, with the
// CRC-32C found there; otherwise the lender computes them as it goes.
func Lend(fd int, size int64, m Memory, board int) (*Lender, error) {
	if size <= 0 {
		return nil, fmt.Errorf("lend: %d bytes: nothing to lend", size)
	}
	fds, args := []int{fd}, append([]string{"--size", strconv.FormatInt(size, 10)}, m.args()...)
	if board >= 0 {
		fds, args = append(fds, board), append(args, "--board")
	}
	cmd, in, out, err := helper("lend", m, fds, args...)
	if err != nil {
		return nil, err
	}
	l := &Lender{cmd: cmd, stdin: in}
	late := time.AfterFunc(StartTime, func() { cmd.Process.Kill() })
	line, err := out.ReadBytes('\n')
	if !late.Stop() {
		err = fmt.Errorf("no grant in %v: killed", StartTime)
	}
	var failed lendFailure
	if err == nil {
		if err = json.Unmarshal(line, &failed); err == nil && failed.Error != "" {
			err = errors.New(failed.Error)
		} else if err == nil {
			err = json.Unmarshal(line, &l.Grant)
		}
	}
	if err != nil {
		l.Close()
		return nil, fmt.Errorf("the lender did not start: %w", err)
	}
	return l, nil
}

// Close ends the lender: its stdin closes, and it exits (killed after 5 s).
func (l *Lender) Close() error {
	l.stdin.Close()
	done := make(chan error, 1)
	go func() { done <- l.cmd.Wait() }()
	select {
	case err := <-done:
		return err
	case <-time.After(5 * time.Second):
		l.cmd.Process.Kill()
		return <-done
	}
}

// FetchOptions are a fetch's: what descriptor 3 is, the board the fetcher
// publishes its progress on (a memfd of BoardSize bytes, for a chain's
// next lender; -1 for none), how long the lender may send nothing before
// the fetch fails, and a function told the bytes checked so far.
type FetchOptions struct {
	Memory   Memory
	Board    int
	Stall    time.Duration
	Progress func(done int64)
}

// DefaultStall is how long a fetch waits for a lender that sends nothing.
const DefaultStall = 30 * time.Second

// fetchLine is what a fetcher writes on stdout: progress, then the end.
type fetchLine struct {
	Done  int64   `json:"done"`
	Error *string `json:"error,omitempty"`
}

// A Fetcher is a fetcher helper started before it is told what to fetch,
// so that its start (the exec, a device's context, UCX's worker) overlaps
// the peer's answer to the pull. Fetch, then Close; or Close alone.
type Fetcher struct {
	cmd   *exec.Cmd
	ctl   int // the daemon's end of the helper's control socket
	out   *bufio.Reader
	stall time.Duration
	done  bool
}

// StartFetcher starts a fetcher of memory like m (its kind and device:
// the allocation's size comes with the job) that fails a fetch after
// stall with nothing from its lender (0: DefaultStall).
func StartFetcher(m Memory, stall time.Duration) (*Fetcher, error) {
	if stall <= 0 {
		stall = DefaultStall
	}
	sp, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("fetch: a control socket: %w", err)
	}
	defer unix.Close(sp[1])
	args := []string{"--stall", stall.String()}
	if m.CUDA {
		args = append(args, "--device", strconv.Itoa(m.Device))
	}
	cmd, in, out, err := helper("fetch", m, []int{sp[1]}, args...)
	if err != nil {
		unix.Close(sp[0])
		return nil, err
	}
	in.Close()
	return &Fetcher{cmd: cmd, ctl: sp[0], out: out, stall: stall}, nil
}

// Fetch fills size bytes of the memory fd from a lender's grant, every
// chunk checked; ctx ends it (the helper is killed). o.Memory gives the
// allocation's size; its kind and device are the Fetcher's.
func (f *Fetcher) Fetch(ctx context.Context, fd int, size int64, g Grant, o FetchOptions) error {
	defer f.Close()
	if err := g.check(size); err != nil {
		return fmt.Errorf("fetch: %w", err)
	}
	job, err := json.Marshal(fetchJob{Grant: g, Alloc: o.Memory.Alloc, Board: o.Board >= 0})
	if err != nil {
		return err
	}
	fds := []int{fd}
	if o.Board >= 0 {
		fds = append(fds, o.Board)
	}
	stop := context.AfterFunc(ctx, func() { f.cmd.Process.Kill() })
	defer stop()
	// A fetcher says how far it got at least once a chunk, each bounded
	// by the stall time: one silent for much longer is stopped (by
	// another process of HelperUser, say) and would hold the pull, and
	// its name, for ever.
	quiet := 4*f.stall + StartTime
	var silent atomic.Bool
	watch := time.AfterFunc(quiet, func() { silent.Store(true); f.cmd.Process.Kill() })
	defer watch.Stop()
	// A helper that failed before it read the job says why on its way out.
	sendErr := unix.Sendmsg(f.ctl, job, unix.UnixRights(fds...), nil, 0)
	var res fetchLine
	for err == nil && res.Error == nil {
		var line []byte
		if line, err = f.out.ReadBytes('\n'); err == nil {
			watch.Reset(quiet)
			res = fetchLine{}
			if err = json.Unmarshal(line, &res); err == nil && res.Error == nil && o.Progress != nil {
				o.Progress(res.Done)
			}
		}
	}
	if err == nil && sendErr == nil && res.Error != nil && *res.Error == "" {
		// Done: the helper takes its context and worker down on its own
		// time, writing nothing more to the segment.
		f.done = true
		unix.Close(f.ctl)
		go f.cmd.Wait()
		return nil
	}
	werr := f.wait()
	switch {
	case ctx.Err() != nil:
		return fmt.Errorf("fetch: %w", context.Cause(ctx))
	case silent.Load():
		return fmt.Errorf("fetch: the fetcher said nothing for %v: killed", quiet)
	case res.Error != nil && *res.Error != "":
		return errors.New(*res.Error)
	case sendErr != nil:
		return fmt.Errorf("fetch: the job to the helper: %w (%v)", sendErr, werr)
	case err != nil:
		return fmt.Errorf("fetch: the helper failed: %v (%v)", err, werr)
	}
	return werr
}

func (f *Fetcher) wait() error {
	if f.done {
		return nil
	}
	f.done = true
	unix.Close(f.ctl)
	return f.cmd.Wait()
}

// Close ends a fetcher that was not given a job, or is done.
func (f *Fetcher) Close() {
	if !f.done {
		f.cmd.Process.Kill()
		f.wait()
	}
}

// Fetch starts a fetcher and fills size bytes of the memory fd from a
// lender's grant, every chunk checked; ctx ends it.
func Fetch(ctx context.Context, fd int, size int64, g Grant, o FetchOptions) error {
	if err := g.check(size); err != nil {
		return fmt.Errorf("fetch: %w", err)
	}
	f, err := StartFetcher(o.Memory, o.Stall)
	if err != nil {
		return err
	}
	return f.Fetch(ctx, fd, size, g, o)
}
