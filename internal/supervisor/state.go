package supervisor

import (
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"syscall"
)

// State is what the supervisor holds for the serving process: for every
// segment, its record (opaque JSON written by the registry) and one
// duplicate of its memory descriptor. Holding the descriptor is holding the
// memory; the record is what a successor needs to serve it.
type State struct {
	entries map[uint64]*entry
	nextID  uint64
	mirror  mirror // systemd's fd store, when in use; nil otherwise
	// journalGen is the generation of the journal systemd handed back
	// (0: none), so that the next one written is newer.
	journalGen int
}

type entry struct {
	rec json.RawMessage // nil: a descriptor handed back without a record
	fd  int             // -1: none (no memory, or the descriptor is missing)
	ctl int             // a channel's control block, or -1
	// seq is the sequence number of rec among the serving process's
	// records (table.go); 0 when it came from another one.
	seq uint64
}

// mirror is told every change, to keep a copy outside this process.
type mirror interface {
	put(st *State, id uint64, e *entry, fdChanged bool)
	del(st *State, id uint64)
	// batch records ops as one change; dropped are the ids whose
	// descriptors it closed.
	batch(st *State, ops []journalOp, dropped []uint64)
}

func newState() *State { return &State{entries: map[uint64]*entry{}} }

// Len is the number of segments held.
func (st *State) Len() int { return len(st.entries) }

// FDs is the number of memory descriptors held.
func (st *State) FDs() int {
	n := 0
	for _, e := range st.entries {
		if e.fd >= 0 {
			n++
		}
	}
	return n
}

// put records rec for id, taking ownership of fd (-1: keep the descriptor
// held, unless the record says the segment has no memory any more) and of
// ctl, a channel's control block (-1: none new).
func (st *State) put(id uint64, rec json.RawMessage, fd, ctl int) {
	e, changed := st.set(id, rec, fd, ctl)
	if st.mirror != nil {
		st.mirror.put(st, id, e, changed)
	}
}

// set is put without telling the mirror; changed says the descriptors
// held for id changed.
func (st *State) set(id uint64, rec json.RawMessage, fd, ctl int) (e *entry, changed bool) {
	st.nextID = max(st.nextID, id)
	e = st.entries[id]
	if e == nil {
		e = &entry{fd: -1, ctl: -1}
		st.entries[id] = e
	}
	e.rec = append(json.RawMessage(nil), rec...)
	if ctl >= 0 {
		closeFD(e.ctl)
		e.ctl, changed = ctl, true
	}
	if fd >= 0 {
		closeFD(e.fd)
		e.fd, changed = fd, true
	} else if e.fd >= 0 && !holdsMemory(rec) {
		closeFD(e.fd)
		closeFD(e.ctl)
		e.fd, e.ctl, changed = -1, -1, true
	}
	return e, changed
}

// seen notes that id's record came with sequence number seq.
func (st *State) seen(id, seq uint64) {
	if e := st.entries[id]; e != nil {
		e.seq = seq
	}
}

// merge takes the records of a record table that are newer than what is
// held, and reports how many. One with no entry is a segment without
// memory, whose records all went to the table: a segment with memory has
// an entry from the message that brought its descriptor, and a deleted
// one's slot was cleared before its deletion was sent.
func (st *State) merge(recs map[uint64]tableRec) int {
	n := 0
	for id, r := range recs {
		if e := st.entries[id]; e != nil && r.seq <= e.seq {
			continue
		}
		st.put(id, r.rec, -1, -1)
		st.seen(id, r.seq)
		n++
	}
	return n
}

// resetSeqs makes every record older than any a new serving process
// writes: it numbers its records from 1.
func (st *State) resetSeqs() {
	for _, e := range st.entries {
		e.seq = 0
	}
}

// del forgets id and closes its descriptor: this process's share of the
// memory is released.
func (st *State) del(id uint64) {
	if st.forget(id) && st.mirror != nil {
		st.mirror.del(st, id)
	}
}

// forget is del without telling the mirror; it reports whether id was held.
func (st *State) forget(id uint64) bool {
	e := st.entries[id]
	if e == nil {
		return false
	}
	delete(st.entries, id)
	closeFD(e.fd)
	closeFD(e.ctl)
	return true
}

// batch applies ops (puts and dels, checked by batchOps) as one change:
// the mirror writes them as one frame of its journal.
func (st *State) batch(ops []journalOp) {
	var dropped []uint64
	for _, op := range ops {
		switch op.Op {
		case "put":
			if _, changed := st.set(op.ID, op.Rec, -1, -1); changed {
				dropped = append(dropped, op.ID)
			}
		case "del":
			if st.forget(op.ID) {
				dropped = append(dropped, op.ID)
			}
		}
	}
	if st.mirror != nil {
		st.mirror.batch(st, ops, dropped)
	}
}

// batchOps checks a batch from a serving process: every part a put of a
// record or a del, of a segment id.
func batchOps(parts []msg) ([]journalOp, error) {
	if len(parts) == 0 {
		return nil, errors.New("an empty batch")
	}
	ops := make([]journalOp, 0, len(parts))
	for _, p := range parts {
		switch {
		case p.ID == 0:
			return nil, fmt.Errorf("a %q without a segment id", p.T)
		case p.T == tPut && isObject(p.Rec):
			ops = append(ops, journalOp{Op: "put", ID: p.ID, Rec: p.Rec})
		case p.T == tDel && p.Rec == nil:
			ops = append(ops, journalOp{Op: "del", ID: p.ID})
		default:
			return nil, fmt.Errorf("segment %d: %q is not a put of a record or a del", p.ID, p.T)
		}
	}
	return ops, nil
}

// release closes every descriptor held, without telling the mirror: what
// the mirror keeps is its own business (see fdStore.stop).
func (st *State) release() {
	for id, e := range st.entries {
		closeFD(e.fd)
		closeFD(e.ctl)
		delete(st.entries, id)
	}
}

func (st *State) ids() []uint64 {
	ids := make([]uint64, 0, len(st.entries))
	for id := range st.entries {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	return ids
}

// holdsMemory reads whether a record says its segment has memory: bytes
// ("alloc") that are not only on disk ("tier").
func holdsMemory(rec json.RawMessage) bool {
	var r struct {
		Alloc int64  `json:"alloc"`
		Tier  string `json:"tier"`
	}
	json.Unmarshal(rec, &r)
	return r.Alloc != 0 && r.Tier != "disk"
}

func closeFD(fd int) {
	if fd >= 0 {
		syscall.Close(fd)
	}
}
