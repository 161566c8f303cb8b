package pull

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm/internal/crc32c"
	"github.com/gpushm/gpushm/internal/ucx"
)

// RunIfHelper runs the helper and exits, when this process was started as
// one (os.Executable __pull VERB ...): for a test binary's TestMain, whose
// package starts helpers, as the gpushm command does through Command.
func RunIfHelper() {
	if len(os.Args) < 2 || os.Args[1] != "__pull" {
		return
	}
	cmd := Command()
	cmd.SetArgs(os.Args[2:])
	if err := cmd.Execute(); err != nil {
		os.Exit(1)
	}
	os.Exit(0)
}

// Command is the hidden __pull command: the helpers' halves, run in
// processes of their own with the segment as descriptor 3 and, where
// --board is given, a board as descriptor 4.
func Command() *cobra.Command {
	cmd := &cobra.Command{Use: "__pull", Hidden: true, Args: cobra.NoArgs,
		PersistentPreRunE: func(*cobra.Command, []string) error { return protocolOut() }}
	var (
		size     int64
		m        Memory
		hasBoard bool
		stall    time.Duration
		uid, gid int
	)
	lend := &cobra.Command{
		Use: "lend", Args: cobra.NoArgs, SilenceUsage: true,
		RunE: func(*cobra.Command, []string) error {
			m.CUDA = m.Device >= 0
			granted := false
			err := harden(uid, gid)
			if err == nil {
				granted, err = runLend(size, m, hasBoard)
			}
			if err != nil && !granted {
				// Why it did not start goes to the daemon, as a
				// fetcher's does, in the place of the grant.
				json.NewEncoder(proto).Encode(lendFailure{Error: err.Error()})
			}
			return err
		},
	}
	lend.Flags().Int64Var(&size, "size", 0, "bytes to lend")
	fetch := &cobra.Command{
		Use: "fetch", Args: cobra.NoArgs, SilenceUsage: true,
		RunE: func(*cobra.Command, []string) error {
			m.CUDA = m.Device >= 0
			return runFetch(m, stall, uid, gid)
		},
	}
	fetch.Flags().DurationVar(&stall, "stall", DefaultStall, "how long the lender may send nothing")
	for _, c := range []*cobra.Command{lend, fetch} {
		c.Flags().IntVar(&m.Device, "device", -1, "the CUDA device of descriptor 3 (-1: a memfd)")
		c.Flags().Int64Var(&m.Alloc, "alloc", 0, "descriptor 3's allocation size, on a device")
		c.Flags().BoolVar(&hasBoard, "board", false, "descriptor 4 is a board")
		c.Flags().IntVar(&uid, "uid", -1, "the user to drop to")
		c.Flags().IntVar(&gid, "gid", -1, "the group to drop to")
	}
	cmd.AddCommand(lend, fetch)
	return cmd
}

// proto is where a helper writes to the daemon: its standard output as it
// was started. Its descriptor 1 then is its standard error, so that what
// a library prints on standard output (UCX's log does, by default) goes
// to the daemon's log instead of into the protocol.
var proto = os.Stdout

func protocolOut() error {
	fd, err := unix.FcntlInt(1, unix.F_DUPFD_CLOEXEC, 3)
	if err != nil {
		return fmt.Errorf("keep standard output: %w", err)
	}
	if err := unix.Dup2(2, 1); err != nil {
		return fmt.Errorf("standard output to standard error: %w", err)
	}
	proto = os.NewFile(uintptr(fd), "protocol")
	return nil
}

// lendFailure is what a lender writes in the place of its grant when it
// cannot start.
type lendFailure struct {
	Error string `json:"error"`
}

// corruptEnv, for tests, makes a lender serve one byte that is not the
// segment's: the fetcher must catch it.
const corruptEnv = "GPUSHM_TEST_LEND_CORRUPT"

// harden drops this helper to uid and gid (when not -1), with no
// supplementary groups, and makes it a process that other processes of
// that user cannot trace or read (/proc/PID/mem), and that gains no
// privilege by exec: whoever takes it over through UCX gets this one
// segment. The kernel clears the parent-death signal as the user changes:
// it is set again, so that the helper still dies with the daemon, and a
// daemon that died before it was is seen by the parent it had.
func harden(uid, gid int) error {
	parent := os.Getppid()
	// The daemon's root may not be the host's: in a user namespace it
	// cannot drop its groups or become a user the namespace does not map.
	const which = "the helpers' user (--pull-helper-user; a daemon in a user namespace cannot)"
	if gid >= 0 {
		if err := syscall.Setgroups(nil); err != nil {
			return fmt.Errorf("drop to %s: drop the groups: %w", which, err)
		}
		if err := syscall.Setresgid(gid, gid, gid); err != nil {
			return fmt.Errorf("drop to %s: gid %d: %w", which, gid, err)
		}
	}
	if uid >= 0 {
		if err := syscall.Setresuid(uid, uid, uid); err != nil {
			return fmt.Errorf("drop to %s: uid %d: %w", which, uid, err)
		}
	}
	if err := unix.Prctl(unix.PR_SET_PDEATHSIG, uintptr(unix.SIGKILL), 0, 0, 0); err != nil {
		return fmt.Errorf("prctl(PR_SET_PDEATHSIG): %w", err)
	}
	if os.Getppid() != parent {
		return errors.New("the daemon that started this helper is gone")
	}
	if err := unix.Prctl(unix.PR_SET_DUMPABLE, 0, 0, 0, 0); err != nil {
		return fmt.Errorf("prctl(PR_SET_DUMPABLE): %w", err)
	}
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		return fmt.Errorf("prctl(PR_SET_NO_NEW_PRIVS): %w", err)
	}
	return nil
}

// mapBoard maps descriptor 4, a board of size bytes' chunks.
func mapBoard(fd int, size int64, writable bool) (board, error) {
	prot := unix.PROT_READ
	if writable {
		prot |= unix.PROT_WRITE
	}
	b, err := unix.Mmap(fd, 0, int(BoardSize(size)), prot, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("map the board: %w", err)
	}
	return board(b), nil
}

// poll is how often a helper looks again at a board that did not move.
const poll = 200 * time.Microsecond

// runLend serves descriptor 3 until stdin closes, and says how to reach it
// on stdout: a Grant. A loop stages each chunk where the fetcher gets it
// (in place for a memfd; through the ring for GPU memory), with its CRC-32C
// (computed here, or from the board of the fetch still filling it), then
// counts it on the board the fetcher reads.
func runLend(size int64, m Memory, hasBoard bool) (granted bool, _ error) {
	var in board // the fetch's board, in a chain
	if hasBoard {
		var err error
		if in, err = mapBoard(4, size, false); err != nil {
			return false, err
		}
		defer unix.Munmap(in)
	}
	// UCX's worker is made while the device's context is: the peer waits
	// for both.
	type made struct {
		c   *ucx.Context
		w   *ucx.Worker
		err error
	}
	ready := make(chan made, 1)
	go func() {
		c, w, err := ucx.Open()
		ready <- made{c, w, err}
	}()
	var src source
	var err error
	if !m.CUDA {
		src, err = newHostSource(3, size)
	} else {
		src, err = newGPUSource(3, m)
	}
	u := <-ready
	if u.err == nil {
		defer u.c.Close()
		defer u.w.Close()
	}
	if err != nil {
		return false, err
	}
	defer src.close()
	if u.err != nil {
		return false, u.err
	}
	c, w := u.c, u.w
	out, err := unix.Mmap(-1, 0, int(BoardSize(size)), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return false, fmt.Errorf("lend: the board: %w", err)
	}
	defer unix.Munmap(out)
	g := Grant{Size: size, Chunk: Chunk, Ring: src.ring()}
	data, err := c.Map(src.region())
	if err != nil {
		return false, err
	}
	defer data.Free()
	bd, err := c.Map(out)
	if err != nil {
		return false, err
	}
	defer bd.Free()
	if g.RKey, err = data.PackKey(); err != nil {
		return false, err
	}
	if g.BoardKey, err = bd.PackKey(); err != nil {
		return false, err
	}
	if g.Worker, err = w.Address(); err != nil {
		return false, err
	}
	g.Addr, g.Board = data.Addr(), bd.Addr()
	if err := json.NewEncoder(proto).Encode(g); err != nil {
		return false, err
	}
	ctx, cancel := context.WithCancelCause(context.Background())
	go func() {
		var buf [1]byte
		os.Stdin.Read(buf[:]) // EOF: the daemon is done with this loan
		cancel(nil)
	}()
	// The stager reads the memory unmapped on return: it ends first.
	staged := make(chan struct{})
	defer func() { cancel(nil); <-staged }()
	go func() {
		defer close(staged)
		if err := stageAll(ctx, src, board(out), in, size); err != nil {
			fmt.Fprintln(os.Stderr, "gpushm-lend:", err)
			cancel(err)
		}
	}()
	err = w.Serve(ctx)
	if ctx.Err() != nil && !errors.Is(context.Cause(ctx), context.Canceled) {
		return true, context.Cause(ctx)
	}
	return true, err
}

// stageAll stages every chunk in order and counts it on out: when the
// fetch's board in says the chunk is there, and the ring has room.
func stageAll(ctx context.Context, src source, out, in board, size int64) error {
	corrupt := os.Getenv(corruptEnv) != ""
	n := (size + Chunk - 1) / Chunk
	for i := int64(0); i < n; i++ {
		for (in != nil && in.ready() <= i) || (src.ring() > 0 && i-out.taken() >= int64(src.ring())) {
			if ctx.Err() != nil {
				return nil
			}
			time.Sleep(poll)
		}
		off, end := i*Chunk, min((i+1)*Chunk, size)
		b, err := src.stage(i, off, end)
		if err != nil {
			return err
		}
		var sum uint32
		if in != nil {
			sum = in.crc(i)
		} else {
			sum = crc32c.Checksum(b)
		}
		if corrupt && off <= size/2 && size/2 < end {
			b[size/2-off] ^= 0x40
		}
		out.setCRC(i, sum)
		out.setReady(i + 1)
	}
	return nil
}

// A fetchJob is what the daemon sends a fetcher over its control socket
// (descriptor 3), with the segment's descriptor and, for a chain, the
// board's, once the peer has answered: the lender's grant, and the
// allocation's size on a device.
type fetchJob struct {
	Grant Grant `json:"grant"`
	Alloc int64 `json:"alloc,omitempty"`
	Board bool  `json:"board,omitempty"`
}

// runFetch makes what a fetch needs before it knows what to fetch (the
// device's context, UCX's worker), then reads a fetchJob on its control
// socket, gets every chunk into the segment, checks each, publishes them
// on the board if any, and writes {"done": bytes} lines as it goes, then
// {"error": ...} (empty for none).
func runFetch(m Memory, stall time.Duration, uid, gid int) error {
	enc := json.NewEncoder(proto)
	reported := false
	report := func(err error) error {
		msg := ""
		if err != nil {
			msg = err.Error()
		}
		reported = true
		return enc.Encode(fetchLine{Error: &msg})
	}
	err := harden(uid, gid)
	if err == nil {
		err = fetch(m, stall, func(done int64) { enc.Encode(fetchLine{Done: done}) }, report)
	}
	if reported {
		return err
	}
	return report(err)
}

// readJob reads the job and its descriptors from the control socket.
func readJob() (fetchJob, []int, error) {
	var j fetchJob
	buf, oob := make([]byte, 1<<20), make([]byte, unix.CmsgSpace(2*4))
	n, oobn, _, _, err := unix.Recvmsg(3, buf, oob, unix.MSG_CMSG_CLOEXEC)
	if err != nil {
		return j, nil, fmt.Errorf("fetch: the job: %w", err)
	}
	var fds []int
	if msgs, err := unix.ParseSocketControlMessage(oob[:oobn]); err == nil {
		for _, m := range msgs {
			if r, err := unix.ParseUnixRights(&m); err == nil {
				fds = append(fds, r...)
			}
		}
	}
	if err := json.Unmarshal(buf[:n], &j); err != nil {
		return j, fds, fmt.Errorf("fetch: the job: %w", err)
	}
	want := 1
	if j.Board {
		want = 2
	}
	if len(fds) != want {
		return j, fds, fmt.Errorf("fetch: the job came with %d descriptors, want %d", len(fds), want)
	}
	return j, fds, nil
}

// fetch reports its success as soon as the last chunk has landed, before
// it takes down the device's context and UCX's worker (a tenth of a second
// and more): the daemon commits the segment meanwhile.
func fetch(m Memory, stall time.Duration, progress func(int64), report func(error) error) error {
	// What can be made before the job, is: a fetch started with its
	// peer's answer still on the way starts the wire when that arrives.
	if m.CUDA {
		if err := warmGPU(m.Device); err != nil {
			return fmt.Errorf("fetch: %w", err)
		}
	}
	c, w, err := ucx.Open()
	if err != nil {
		return err
	}
	defer c.Close()
	defer w.Close()
	job, fds, err := readJob()
	for _, fd := range fds {
		defer unix.Close(fd)
	}
	if err != nil {
		return err
	}
	g, m := job.Grant, Memory{CUDA: m.CUDA, Device: m.Device, Alloc: job.Alloc}
	if err := g.check(g.Size); err != nil {
		return fmt.Errorf("fetch: %w", err)
	}
	var pub board // for the next lender of a chain
	if job.Board {
		if pub, err = mapBoard(fds[1], g.Size, true); err != nil {
			return err
		}
		defer unix.Munmap(pub)
	}
	var dst sink
	if !m.CUDA {
		dst, err = newHostSink(fds[0], g.Size)
	} else {
		dst, err = newGPUSink(fds[0], m)
	}
	if err != nil {
		return err
	}
	defer dst.close()
	ep, err := w.Connect(g.Worker)
	if err != nil {
		return err
	}
	defer ep.Close()
	f := &fetcher{ep: ep, g: g, stall: stall, crcs: make([]uint32, g.chunks())}
	if err := f.run(dst, pub, progress); err != nil {
		return err
	}
	return report(nil)
}

// run gets every chunk into dst, checks it, and publishes it on pub (if
// any), in two stages: this loop waits for each chunk on the lender's
// board and gets it; a checker checks it, hands it to the sink and
// publishes it, while the next is on the wire.
func (f *fetcher) run(dst sink, pub board, progress func(int64)) error {
	g := f.g
	landed := func(k int64) {
		if pub != nil && k > 0 {
			pub.setReady(k)
		}
	}
	type fetched struct {
		i, off, end int64
		b           []byte
	}
	work := make(chan fetched, 1)
	var checkErr atomic.Pointer[error]
	checked := make(chan struct{})
	go func() {
		defer close(checked)
		last := time.Now()
		for c := range work {
			if checkErr.Load() != nil {
				continue
			}
			if err := f.check(c.b, c.i, c.off, c.end); err != nil {
				checkErr.Store(&err)
				continue
			}
			if pub != nil {
				pub.setCRC(c.i, f.crcs[c.i])
			}
			k, err := dst.put(c.i, c.off, c.b)
			if err != nil {
				checkErr.Store(&err)
				continue
			}
			landed(k)
			if time.Since(last) > 100*time.Millisecond {
				progress(c.end)
				last = time.Now()
			}
		}
	}()
	err := func() error {
		defer close(work)
		for i := int64(0); i < g.chunks() && checkErr.Load() == nil; i++ {
			off, end := i*g.Chunk, min((i+1)*g.Chunk, g.Size)
			if err := f.staged(i); err != nil {
				return err
			}
			b, err := dst.buf(i, end-off)
			if err != nil {
				return err
			}
			if err := f.get(b, i, off, end); err != nil {
				return err
			}
			work <- fetched{i, off, end, b}
		}
		return nil
	}()
	<-checked
	if e := checkErr.Load(); e != nil {
		return *e
	}
	if err != nil {
		return err
	}
	k, err := dst.flush()
	if err != nil {
		return err
	}
	landed(k)
	progress(g.Size)
	return nil
}

// A fetcher reads a lender's board and chunks.
type fetcher struct {
	ep     *ucx.Endpoint
	g      Grant
	stall  time.Duration
	ready  int64    // chunks the lender's board counted, when last read
	crcs   []uint32 // their checksums
	header [boardHeader]byte
}

// staged waits until the lender's board counts chunk i, reading the
// checksums it adds; a lender that adds none for the stall time fails it.
func (f *fetcher) staged(i int64) error {
	since := time.Now()
	for f.ready <= i {
		if err := f.read(f.header[:], f.g.Board, "its board"); err != nil {
			return err
		}
		r := int64(binary.LittleEndian.Uint64(f.header[:8]))
		if r > f.g.chunks() || r < f.ready {
			return fmt.Errorf("fetch: the lender's board counts %d chunks of %d (before: %d): the peer sent wrong bytes", r, f.g.chunks(), f.ready)
		}
		if r > f.ready {
			b := make([]byte, 4*(r-f.ready))
			if err := f.read(b, f.g.Board+boardHeader+4*uint64(f.ready), "its checksums"); err != nil {
				return err
			}
			for k := range r - f.ready {
				f.crcs[f.ready+k] = binary.LittleEndian.Uint32(b[4*k:])
			}
			f.ready = r
			break
		}
		if time.Since(since) > f.stall {
			return fmt.Errorf("fetch: the lender staged nothing for %v (chunk %d of %d): %w", f.stall, i, f.g.chunks(), errStalled)
		}
		time.Sleep(poll)
	}
	return nil
}

var errStalled = errors.New("it stopped sending")

// read gets len(b) bytes at addr of the lender's board, within the stall
// time.
func (f *fetcher) read(b []byte, addr uint64, what string) error {
	ctx, cancel := context.WithTimeout(context.Background(), f.stall)
	defer cancel()
	if err := f.ep.Get(ctx, b, addr, f.g.BoardKey); err != nil {
		if ctx.Err() != nil {
			return fmt.Errorf("fetch: reading %s: no answer in %v: %w", what, f.stall, errStalled)
		}
		return fmt.Errorf("fetch: reading %s: %w", what, err)
	}
	return nil
}

// get reads chunk i, bytes [off, end), into b, and tells a lender with a
// ring that its slot is free.
func (f *fetcher) get(b []byte, i, off, end int64) error {
	addr := f.g.Addr + uint64(off)
	if f.g.Ring > 0 {
		addr = f.g.Addr + uint64((i%int64(f.g.Ring))*f.g.Chunk)
	}
	ctx, cancel := context.WithTimeout(context.Background(), f.stall)
	err := f.ep.Get(ctx, b, addr, f.g.RKey)
	timedOut := ctx.Err() != nil
	cancel()
	switch {
	case err != nil && timedOut:
		return fmt.Errorf("fetch: bytes %d to %d: none for %v: %w", off, end, f.stall, errStalled)
	case err != nil:
		return fmt.Errorf("fetch: bytes %d to %d: %w", off, end, err)
	}
	if f.g.Ring > 0 {
		taken := binary.LittleEndian.AppendUint64(nil, uint64(i+1))
		ctx, cancel := context.WithTimeout(context.Background(), f.stall)
		defer cancel()
		if err := f.ep.Put(ctx, taken, f.g.Board+8, f.g.BoardKey); err != nil {
			return fmt.Errorf("fetch: telling the lender chunk %d is taken: %w", i, err)
		}
	}
	return nil
}

// check checks chunk i, bytes [off, end), in b, against the lender's
// checksum.
func (f *fetcher) check(b []byte, i, off, end int64) error {
	if got := crc32c.Checksum(b); got != f.crcs[i] {
		return fmt.Errorf("fetch: chunk %d (bytes %d to %d) fails its checksum (crc32c %08x, the lender's %08x): the peer sent wrong bytes", i, off, end, got, f.crcs[i])
	}
	return nil
}
