package supervisor

import (
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm/internal/segment"
)

func tableRecord(id uint64, n int) []byte {
	return fmt.Appendf(nil, `{"id":%d,"name":"s%d","alloc":4096,"holders":[{"pid":%d,"start":1,"n":1}]}`, id, id, n)
}

// TestTable: the newest record of each segment comes back; a half that a
// writer killed mid-write left behind does not, and the record before it
// does; a dropped segment's slot says nothing and is used again; a record
// too large for a half is refused (it goes as a message).
func TestTable(t *testing.T) {
	tb, err := newLeaseTable()
	if err != nil {
		t.Fatal(err)
	}
	defer tb.close()
	for seq := uint64(1); seq <= 5; seq++ {
		if !tb.put(7, seq, tableRecord(7, int(seq))) {
			t.Fatal("put refused")
		}
	}
	tb.put(8, 6, tableRecord(8, 1))
	tb.put(9, 7, tableRecord(9, 1))
	tb.drop(9)
	// A write of record 8, killed after it cleared its half and wrote the
	// bytes, before its sequence number: the half that held seq 6 is
	// intact, the other one (being written) is empty.
	i := tb.slot[8]
	h := 1 - tb.last[i]
	off := tablePage + i*slotBytes + int(h)*halfBytes
	copy(tb.mem[off+halfHeader:], `{"id":8,"torn`)
	got, err := readTable(tb.fd)
	if err != nil {
		t.Fatal(err)
	}
	if r := got[7]; r.seq != 5 || !strings.Contains(string(r.rec), `"pid":5`) {
		t.Fatalf("segment 7: %d %s, want the record of seq 5", r.seq, r.rec)
	}
	if r := got[8]; r.seq != 6 || string(r.rec) != string(tableRecord(8, 1)) {
		t.Fatalf("segment 8: %d %s, want the record of seq 6", r.seq, r.rec)
	}
	if r, ok := got[9]; ok {
		t.Fatalf("dropped segment 9 read back: %d %s", r.seq, r.rec)
	}
	// 9's slot goes to the next new segment.
	slot9 := len(tb.free)
	tb.put(10, 8, tableRecord(10, 1))
	if len(tb.free) != slot9-1 {
		t.Fatalf("the dropped slot was not used again (free %v)", tb.free)
	}
	if tb.put(11, 9, []byte(`{"id":11,"meta":"`+strings.Repeat("x", maxTableRec)+`"}`)) {
		t.Fatal("a record larger than a half went into the table")
	}
}

// TestTableMerge: a serving process's records that went into its table
// reach a successor's state, newer than the messages before them, and
// older than a message after them; a segment whose records all went to
// the table (no memory) is merged in; the sequence restarts with the next
// serving process.
func TestTableMerge(t *testing.T) {
	st := newState()
	s, c, l := controlPair(t, st)
	l.batches = true
	l.mu.Lock()
	l.startTableLocked()
	l.mu.Unlock()
	if l.table == nil {
		t.Fatal("no table")
	}
	fd := memfd(t, 4096)
	defer unix.Close(fd)
	rec := func(id uint64, pid int) segment.Record {
		return segment.Record{ID: id, Name: fmt.Sprint("s", id), Linked: true, Size: 4096, Alloc: 4096, Leases: true,
			Holders: []segment.Holder{{PID: pid, Start: 1, N: 1}}}
	}
	l.Put(rec(1, 100), fd, -1) // message, with the memory
	l.Put(rec(1, 101), -1, -1) // table
	l.Put(rec(2, 200), fd, -1) // message
	l.Put(rec(2, 201), -1, -1) // table
	l.Put(rec(2, 202), fd, -1) // message, newer than the table
	empty := segment.Record{ID: 3, Name: "empty", Linked: true}
	l.Put(empty, -1, -1)       // table only
	l.Put(rec(4, 400), fd, -1) // message
	l.Put(rec(4, 401), -1, -1) // table
	l.Delete(4)                // gone: its slot says nothing
	if types := applyQueued(t, s, c, l); !slices.Equal(types, []string{tTable, tPut, tPut, tPut, tPut, tDel}) {
		t.Fatalf("messages: %v", types)
	}
	s.endTable(c)
	holder := func(id uint64) int {
		e := st.entries[id]
		if e == nil {
			return -1
		}
		var r segment.Record
		if err := json.Unmarshal(e.rec, &r); err != nil {
			t.Fatal(err)
		}
		if len(r.Holders) == 0 {
			return 0
		}
		return r.Holders[0].PID
	}
	if got := holder(1); got != 101 {
		t.Errorf("segment 1: holder %d, want 101 (the table's, newer)", got)
	}
	if got := holder(2); got != 202 {
		t.Errorf("segment 2: holder %d, want 202 (the message's, newer)", got)
	}
	if e := st.entries[3]; e == nil || e.fd != -1 {
		t.Errorf("segment 3 (no memory, table only): %+v", e)
	}
	if e := st.entries[4]; e != nil {
		t.Errorf("deleted segment 4 came back: %s", e.rec)
	}
	if c.table != -1 {
		t.Error("the table was not let go")
	}
	st.resetSeqs()
	for id, e := range st.entries {
		if e.seq != 0 {
			t.Errorf("segment %d: seq %d after reset", id, e.seq)
		}
	}
}

func BenchmarkReadTable(b *testing.B) {
	tb, err := newLeaseTable()
	if err != nil {
		b.Fatal(err)
	}
	defer tb.close()
	for id := uint64(1); id <= 10000; id++ {
		tb.put(id, id, tableRecord(id, int(id)))
	}
	for b.Loop() {
		if recs, err := readTable(tb.fd); err != nil || len(recs) != 10000 {
			b.Fatal(len(recs), err)
		}
	}
}
