package supervisor

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"os"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The record table. Every open and close changes its segment's leases, and
// so its record, which the journal must hold before the reply goes out; a
// message to the supervisor for each was 2.5 us of an open's 6 in the
// serving process on an H200 machine, most of what stood between the
// round trip and a bare echo server's. A record that comes without a new
// descriptor goes instead into memory the supervisor shares (a memfd it
// was sent once): a slot a segment, two halves a slot, the newer record
// written into the older half, its sequence number last. The supervisor
// reads the table only when the serving process is gone, or parked for an
// upgrade, so nothing reads a half while it is written; a process killed
// while writing one leaves that half's sequence number 0 (it is cleared
// first), and the other half holds the record before. Messages and slots
// share one sequence: for each segment the supervisor keeps whichever of
// its last message and its slot is newer. A record too large for a half,
// or one beyond the table's slots, goes as a message, as all did before.

const (
	tableSlots = 1 << 16
	halfBytes  = 2048
	slotBytes  = 2 * halfBytes
	// A half: sequence number (0: empty), segment id, record length, the
	// record.
	halfHeader  = 24
	maxTableRec = halfBytes - halfHeader
	// The table's first page: a magic number and how many slots were
	// ever used, so that a reader reads no further.
	tablePage  = 4096
	tableMagic = 0x67707573686d7431 // "gpushmt1"
	tableBytes = tablePage + tableSlots*slotBytes
)

// leaseTable is the serving process's end: it writes. The Link's mu
// guards it.
type leaseTable struct {
	fd   int
	mem  []byte
	slot map[uint64]int // segment id -> slot
	free []int
	used int
	last []uint8 // the half each slot's last record went to
}

func newLeaseTable() (*leaseTable, error) {
	fd, err := unix.MemfdCreate("gpushm-records", unix.MFD_CLOEXEC)
	if err != nil {
		return nil, os.NewSyscallError("memfd_create", err)
	}
	if err := unix.Ftruncate(fd, tableBytes); err != nil {
		unix.Close(fd)
		return nil, os.NewSyscallError("ftruncate", err)
	}
	mem, err := unix.Mmap(fd, 0, tableBytes, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		unix.Close(fd)
		return nil, os.NewSyscallError("mmap", err)
	}
	binary.LittleEndian.PutUint64(mem, tableMagic)
	return &leaseTable{fd: fd, mem: mem, slot: map[uint64]int{}, last: make([]uint8, tableSlots)}, nil
}

func word(mem []byte, off int) *uint64 { return (*uint64)(unsafe.Pointer(&mem[off])) }

// put writes rec, segment id's record, with sequence number seq; false
// when it does not fit (the caller sends it as a message).
func (t *leaseTable) put(id, seq uint64, rec []byte) bool {
	if len(rec) > maxTableRec {
		return false
	}
	i, ok := t.slot[id]
	if !ok {
		switch {
		case len(t.free) > 0:
			i = t.free[len(t.free)-1]
			t.free = t.free[:len(t.free)-1]
		case t.used < tableSlots:
			i = t.used
			t.used++
			atomic.StoreUint64(word(t.mem, 8), uint64(t.used))
		default:
			return false
		}
		t.slot[id] = i
		t.last[i] = 1 // the first record goes to half 0
	}
	h := 1 - t.last[i]
	off := tablePage + i*slotBytes + int(h)*halfBytes
	atomic.StoreUint64(word(t.mem, off), 0)
	binary.LittleEndian.PutUint64(t.mem[off+8:], id)
	binary.LittleEndian.PutUint64(t.mem[off+16:], uint64(len(rec)))
	copy(t.mem[off+halfHeader:], rec)
	atomic.StoreUint64(word(t.mem, off), seq)
	t.last[i] = h
	return true
}

// drop forgets segment id's slot: it was deleted, or its record went as a
// message, which is then newer than anything the slot holds.
func (t *leaseTable) drop(id uint64) {
	i, ok := t.slot[id]
	if !ok {
		return
	}
	delete(t.slot, id)
	for h := range 2 {
		atomic.StoreUint64(word(t.mem, tablePage+i*slotBytes+h*halfBytes), 0)
	}
	t.free = append(t.free, i)
}

func (t *leaseTable) close() {
	unix.Munmap(t.mem)
	unix.Close(t.fd)
}

// tableRec is a record read from a table, and its sequence number.
type tableRec struct {
	seq uint64
	rec json.RawMessage
}

// readTable returns the newest record of each segment in the table at fd
// (a serving process's, sent with "table"), which nobody writes now.
func readTable(fd int) (map[uint64]tableRec, error) {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, os.NewSyscallError("fstat", err)
	}
	if st.Size != tableBytes {
		return nil, fmt.Errorf("record table of %d bytes, want %d", st.Size, tableBytes)
	}
	mem, err := unix.Mmap(fd, 0, tableBytes, unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return nil, os.NewSyscallError("mmap", err)
	}
	defer unix.Munmap(mem)
	if binary.LittleEndian.Uint64(mem) != tableMagic {
		return nil, fmt.Errorf("not a record table")
	}
	used := min(int(atomic.LoadUint64(word(mem, 8))), tableSlots)
	out := map[uint64]tableRec{}
	for i := range used * 2 {
		off := tablePage + i*halfBytes
		seq := atomic.LoadUint64(word(mem, off))
		id := binary.LittleEndian.Uint64(mem[off+8:])
		n := binary.LittleEndian.Uint64(mem[off+16:])
		if seq == 0 || id == 0 || n > maxTableRec {
			continue
		}
		rec := json.RawMessage(append([]byte(nil), mem[off+halfHeader:off+halfHeader+int(n)]...))
		// An object, checked without decoding it (a restart reads every
		// slot): valid JSON that starts with a brace.
		if n == 0 || rec[0] != '{' || !json.Valid(rec) {
			continue
		}
		if cur, ok := out[id]; !ok || seq > cur.seq {
			out[id] = tableRec{seq, rec}
		}
	}
	return out, nil
}
