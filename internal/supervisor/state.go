package supervisor

import (
	"encoding/json"
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
}

// mirror is told every change, to keep a copy outside this process.
type mirror interface {
	put(st *State, id uint64, e *entry, fdChanged bool)
	del(st *State, id uint64)
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
	st.nextID = max(st.nextID, id)
	e := st.entries[id]
	if e == nil {
		e = &entry{fd: -1, ctl: -1}
		st.entries[id] = e
	}
	e.rec = append(json.RawMessage(nil), rec...)
	changed := false
	if ctl >= 0 {
		closeFD(e.ctl)
		e.ctl, changed = ctl, true
	}
	if fd >= 0 {
		closeFD(e.fd)
		e.fd, changed = fd, true
	} else if e.fd >= 0 && allocOf(rec) == 0 {
		closeFD(e.fd)
		closeFD(e.ctl)
		e.fd, e.ctl, changed = -1, -1, true
	}
	if st.mirror != nil {
		st.mirror.put(st, id, e, changed)
	}
}

// del forgets id and closes its descriptor: this process's share of the
// memory is released.
func (st *State) del(id uint64) {
	e := st.entries[id]
	if e == nil {
		return
	}
	delete(st.entries, id)
	closeFD(e.fd)
	closeFD(e.ctl)
	if st.mirror != nil {
		st.mirror.del(st, id)
	}
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

// allocOf reads a record's "alloc": the bytes of memory it says it has.
func allocOf(rec json.RawMessage) int64 {
	var r struct {
		Alloc int64 `json:"alloc"`
	}
	json.Unmarshal(rec, &r)
	return r.Alloc
}

func closeFD(fd int) {
	if fd >= 0 {
		syscall.Close(fd)
	}
}
