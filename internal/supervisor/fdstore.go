package supervisor

import (
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strconv"
	"strings"

	"github.com/coreos/go-systemd/v22/activation"
	"github.com/coreos/go-systemd/v22/daemon"
	"golang.org/x/sys/unix"
)

// Under systemd the supervisor copies what it holds into the service's
// file descriptor store (FDSTORE=1), so that a restart of the whole service
// (a crash of the supervisor itself, or 'systemctl restart' with
// FileDescriptorStorePreserve=) hands it all back through LISTEN_FDS. The
// names: "listener", "epoch", "seg-ID" for each segment's memory, and
// "journal-GEN", a memfd holding the journal (journal.go), rewritten under
// a new generation when it has grown too much.

// notify sends state to systemd; it does nothing outside systemd.
func notify(state string) {
	daemon.SdNotify(false, state)
}

// notifyFD sends state with one descriptor attached. go-systemd's SdNotify
// sends no descriptors, and FDSTORE=1 needs them.
func notifyFD(state string, fd int) error {
	addr := os.Getenv("NOTIFY_SOCKET")
	if addr == "" {
		return nil
	}
	if addr[0] == '@' {
		addr = "\x00" + addr[1:]
	}
	s, err := unix.Socket(unix.AF_UNIX, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("notify socket: %w", err)
	}
	defer unix.Close(s)
	var oob []byte
	if fd >= 0 {
		oob = unix.UnixRights(fd)
	}
	if err := unix.Sendmsg(s, []byte(state), oob, &unix.SockaddrUnix{Name: addr}, 0); err != nil {
		return fmt.Errorf("notify %q: %w", strings.SplitN(state, "\n", 2)[0], err)
	}
	return nil
}

// StoreWanted reports whether systemd offers a file descriptor store:
// NOTIFY_SOCKET, and FDSTORE (set by systemd 254 and later when the unit
// has FileDescriptorStoreMax=).
func StoreWanted() bool {
	n, _ := strconv.Atoi(os.Getenv("FDSTORE"))
	return os.Getenv("NOTIFY_SOCKET") != "" && n > 0
}

type fdStore struct {
	log     *slog.Logger
	journal int   // memfd, -1 before the first compaction
	gen     int   // its generation, in its name
	written int64 // bytes in it
	base    int64 // bytes right after the last compaction
}

func newFDStore(st *State, log *slog.Logger, listener, epoch *os.File) (*fdStore, error) {
	if os.Getenv("NOTIFY_SOCKET") == "" {
		return nil, fmt.Errorf("--fd-store needs systemd (NOTIFY_SOCKET is not set)")
	}
	f := &fdStore{log: log, journal: -1, gen: st.journalGen}
	// Systemd drops a descriptor it already holds, so storing again what
	// it handed back is harmless.
	if err := f.store("listener", int(listener.Fd())); err != nil {
		return nil, err
	}
	if err := f.store("epoch", int(epoch.Fd())); err != nil {
		return nil, err
	}
	if err := f.compact(st); err != nil {
		return nil, err
	}
	for _, id := range st.ids() {
		e := st.entries[id]
		if e.fd >= 0 {
			if err := f.store(segName(id), e.fd); err != nil {
				return nil, err
			}
		}
		if e.ctl >= 0 {
			if err := f.store(ctlName(id), e.ctl); err != nil {
				return nil, err
			}
		}
	}
	return f, nil
}

func segName(id uint64) string { return "seg-" + strconv.FormatUint(id, 10) }

func (f *fdStore) store(name string, fd int) error {
	return notifyFD("FDSTORE=1\nFDPOLL=0\nFDNAME="+name, fd)
}

func (f *fdStore) remove(name string) error {
	return notifyFD("FDSTOREREMOVE=1\nFDNAME="+name, -1)
}

func (f *fdStore) put(st *State, id uint64, e *entry, fdChanged bool) {
	f.append(st, journalOp{Op: "put", ID: id, Rec: e.rec})
	if fdChanged {
		f.check(f.remove(segName(id)))
		f.check(f.remove(ctlName(id)))
		if e.fd >= 0 {
			f.check(f.store(segName(id), e.fd))
		}
		if e.ctl >= 0 {
			f.check(f.store(ctlName(id), e.ctl))
		}
	}
}

func (f *fdStore) del(st *State, id uint64) {
	f.append(st, journalOp{Op: "del", ID: id})
	f.check(f.remove(segName(id)))
	f.check(f.remove(ctlName(id)))
}

func (f *fdStore) batch(st *State, ops []journalOp, dropped []uint64) {
	f.append(st, journalOp{Op: "batch", Ops: ops})
	for _, id := range dropped {
		f.check(f.remove(segName(id)))
		f.check(f.remove(ctlName(id)))
	}
}

func ctlName(id uint64) string { return "ctl-" + strconv.FormatUint(id, 10) }

func (f *fdStore) check(err error) {
	if err != nil {
		f.log.Error("systemd fd store", "err", err)
	}
}

// append writes one frame, or rewrites the journal when it has grown to
// several times what the state needs.
func (f *fdStore) append(st *State, op journalOp) {
	if f.written > 4*f.base+1<<20 {
		f.check(f.compact(st))
		return
	}
	b := appendFrame(nil, op)
	if _, err := unix.Pwrite(f.journal, b, f.written); err != nil {
		f.log.Error("write journal; rewriting it", "err", err)
		f.check(f.compact(st))
		return
	}
	f.written += int64(len(b))
}

// compact writes the whole state to a new journal, stores it, and only then
// removes the old one: a crash in between leaves two, and the newer wins.
func (f *fdStore) compact(st *State) error {
	fd, err := unix.MemfdCreate("gpushm-journal", unix.MFD_CLOEXEC)
	if err != nil {
		return fmt.Errorf("journal memfd: %w", err)
	}
	b := encodeJournal(st)
	if _, err := unix.Pwrite(fd, b, 0); err != nil {
		unix.Close(fd)
		return fmt.Errorf("write journal: %w", err)
	}
	gen := f.gen + 1
	if err := f.store("journal-"+strconv.Itoa(gen), fd); err != nil {
		unix.Close(fd)
		return err
	}
	if f.journal >= 0 || f.gen > 0 {
		f.check(f.remove("journal-" + strconv.Itoa(f.gen)))
	}
	if f.journal >= 0 {
		unix.Close(f.journal)
	}
	f.journal, f.gen, f.written, f.base = fd, gen, int64(len(b)), int64(len(b))
	return nil
}

// Handed is what systemd handed back to a restarted service.
type Handed struct {
	Listener *os.File // nil: make one
	Epoch    *os.File // nil: make one
	State    *State
}

// FromSystemd reads the descriptors systemd passed (LISTEN_FDS), if any:
// the listening socket (stored, or from a .socket unit), the epoch page,
// the newest journal and the segments' memory. What cannot be matched is
// kept and reported rather than freed: a descriptor without a record comes
// back as an orphan, a record without its descriptor likewise; a journal
// that does not decode to the end gives the records before the damage.
func FromSystemd(log *slog.Logger) *Handed {
	h := &Handed{State: newState()}
	files := activation.Files(true)
	if len(files) == 0 {
		return h
	}
	type journalFile struct {
		gen int
		f   *os.File
	}
	var journals []journalFile
	segs := map[uint64]int{}
	ctls := map[uint64]int{}
	var extra []int
	for _, f := range files {
		name := f.Name()
		switch {
		case name == "listener":
			h.Listener = keep(h.Listener, f, log)
		case name == "epoch":
			h.Epoch = keep(h.Epoch, f, log)
		case strings.HasPrefix(name, "journal-"):
			gen, err := strconv.Atoi(strings.TrimPrefix(name, "journal-"))
			if err != nil {
				log.Error("systemd handed back a descriptor with a bad journal name; ignoring it", "name", name)
				f.Close()
				continue
			}
			journals = append(journals, journalFile{gen, f})
		case strings.HasPrefix(name, "seg-"):
			id, err := strconv.ParseUint(strings.TrimPrefix(name, "seg-"), 10, 64)
			fd := dupFile(f)
			if fd < 0 {
				continue
			}
			if err != nil || id == 0 {
				log.Error("systemd handed back a segment descriptor with a bad name; keeping it as an orphan", "name", name)
				extra = append(extra, fd)
			} else if _, dup := segs[id]; dup {
				log.Error("systemd handed back two descriptors for one segment; keeping the second as an orphan", "name", name)
				extra = append(extra, fd)
			} else {
				segs[id] = fd
			}
		case strings.HasPrefix(name, "ctl-"):
			id, err := strconv.ParseUint(strings.TrimPrefix(name, "ctl-"), 10, 64)
			fd := dupFile(f)
			if fd < 0 {
				continue
			}
			if _, dup := ctls[id]; err != nil || dup {
				log.Error("systemd handed back a control block with a bad or repeated name; closing it", "name", name)
				closeFD(fd)
				continue
			}
			ctls[id] = fd
		case isListener(f):
			h.Listener = keep(h.Listener, f, log)
		default:
			log.Warn("systemd handed back a descriptor gpushm does not know; leaving it in the store", "name", name)
			f.Close()
		}
	}
	slices.SortFunc(journals, func(a, b journalFile) int { return b.gen - a.gen })
	var recs map[uint64][]byte
	var nextID uint64
	for i, j := range journals {
		if i == 0 {
			h.State.journalGen = j.gen
			recs, nextID = readJournal(j.f, j.gen, log)
		}
		j.f.Close()
	}
	if len(journals) == 0 && len(segs) > 0 {
		log.Error("systemd handed back segments but no journal; keeping them as orphans", "segments", len(segs))
	}
	st := h.State
	for id, rec := range recs {
		fd, ok := segs[id]
		if !ok {
			fd = -1
		} else {
			delete(segs, id)
		}
		st.entries[id] = &entry{rec: rec, fd: fd, ctl: -1}
		st.nextID = max(st.nextID, id)
	}
	for id, fd := range segs {
		st.entries[id] = &entry{fd: fd, ctl: -1}
		st.nextID = max(st.nextID, id)
	}
	for id, fd := range ctls {
		if e := st.entries[id]; e != nil {
			e.ctl = fd
		} else {
			log.Error("systemd handed back a control block of no segment it knows; closing it", "id", id)
			closeFD(fd)
		}
	}
	st.nextID = max(st.nextID, nextID)
	for _, fd := range extra {
		st.nextID++
		st.entries[st.nextID] = &entry{fd: fd, ctl: -1}
	}
	log.Info("systemd handed back the service's state", "segments", st.Len(), "descriptors", st.FDs(), "journal_generation", st.journalGen)
	return h
}

func readJournal(f *os.File, gen int, log *slog.Logger) (map[uint64][]byte, uint64) {
	out := map[uint64][]byte{}
	fi, err := f.Stat()
	if err != nil {
		log.Error("journal unreadable; segments come back as orphans", "generation", gen, "err", err)
		return out, 0
	}
	b, err := readAll(f, fi.Size())
	if err != nil {
		log.Error("journal unreadable; segments come back as orphans", "generation", gen, "err", err)
		return out, 0
	}
	recs, next, err := decodeJournal(b)
	if err != nil {
		log.Error("journal damaged: serving what it recorded before the damage; descriptors it does not name come back as orphans",
			"generation", gen, "records", len(recs), "err", err)
	}
	for id, r := range recs {
		out[id] = r
	}
	return out, next
}

// keep keeps the first of a kind and closes any other.
func keep(have, f *os.File, log *slog.Logger) *os.File {
	if have != nil {
		log.Warn("systemd handed back two descriptors of one kind; keeping the first", "name", f.Name())
		f.Close()
		return have
	}
	return f
}

// dupFile takes the descriptor out of f as a plain int.
func dupFile(f *os.File) int {
	fd, err := unix.FcntlInt(f.Fd(), unix.F_DUPFD_CLOEXEC, 0)
	f.Close()
	if err != nil {
		return -1
	}
	return fd
}

func isListener(f *os.File) bool {
	typ, err := unix.GetsockoptInt(int(f.Fd()), unix.SOL_SOCKET, unix.SO_TYPE)
	if err != nil || typ != unix.SOCK_SEQPACKET {
		return false
	}
	acc, err := unix.GetsockoptInt(int(f.Fd()), unix.SOL_SOCKET, unix.SO_ACCEPTCONN)
	return err == nil && acc == 1
}
