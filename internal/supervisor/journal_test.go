package supervisor

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"testing"

	"golang.org/x/sys/unix"
)

func testState(t *testing.T, n int) *State {
	t.Helper()
	st := newState()
	for i := 1; i <= n; i++ {
		st.put(uint64(i), json.RawMessage(fmt.Sprintf(`{"id":%d,"name":"s%d","alloc":4096}`, i, i)), -1, -1)
	}
	st.nextID = uint64(n + 10)
	return st
}

// renameOver is the batch a rename of segment 1 over segment 3's name
// journals: 3 freed, 1 renamed.
var renameOver = journalOp{Op: "batch", Ops: []journalOp{
	{Op: "del", ID: 3},
	{Op: "put", ID: 1, Rec: json.RawMessage(`{"id":1,"name":"s3","alloc":4096}`)},
}}

func TestJournalRoundTrip(t *testing.T) {
	st := testState(t, 5)
	b := encodeJournal(st)
	b = appendFrame(b, journalOp{Op: "del", ID: 2})
	b = appendFrame(b, journalOp{Op: "put", ID: 6, Rec: json.RawMessage(`{"id":6}`)})
	b = appendFrame(b, renameOver)
	recs, next, err := decodeJournal(b)
	if err != nil {
		t.Fatal(err)
	}
	if len(recs) != 4 || recs[2] != nil || recs[3] != nil || string(recs[6]) != `{"id":6}` || next != 15 {
		t.Fatalf("decoded %d records (2: %s, 3: %s, 6: %s), next %d", len(recs), recs[2], recs[3], recs[6], next)
	}
	if got := string(recs[1]); got != `{"id":1,"name":"s3","alloc":4096}` {
		t.Fatalf("record 1 after the batch: %s", got)
	}
}

// Every truncation of a journal reads as the records of the frames that
// are whole, and one that cuts a frame says where; none panics or invents
// a record, and a batch cut short counts for nothing.
func TestJournalTruncated(t *testing.T) {
	b := encodeJournal(testState(t, 3))
	b = appendFrame(b, renameOver)
	b = appendFrame(b, journalOp{Op: "put", ID: 4, Rec: json.RawMessage(`{"id":4}`)})
	boundaries := []int{len(journalMagic)}
	for off := len(journalMagic); off < len(b); {
		off += 8 + int(binary.LittleEndian.Uint32(b[off:]))
		boundaries = append(boundaries, off)
	}
	for n := len(journalMagic); n <= len(b); n++ {
		last := 0
		for _, at := range boundaries {
			if at <= n {
				last = at
			}
		}
		want, _, err := decodeJournal(b[:last])
		if err != nil {
			t.Fatalf("whole frames up to %d: %v", last, err)
		}
		recs, _, err := decodeJournal(b[:n])
		if (err == nil) != (n == last) {
			t.Fatalf("cut at %d: error %v", n, err)
		}
		if !maps.EqualFunc(recs, want, func(a, b json.RawMessage) bool { return string(a) == string(b) }) {
			t.Fatalf("cut at %d: %d records, want the %d of the whole frames", n, len(recs), len(want))
		}
	}
}

// A batch with a bad part is refused whole: its good parts are not
// applied either.
func TestJournalBadBatch(t *testing.T) {
	for _, tc := range []struct {
		name string
		op   journalOp
	}{
		{"empty", journalOp{Op: "batch"}},
		{"a put without a record", journalOp{Op: "batch", Ops: []journalOp{{Op: "del", ID: 1}, {Op: "put", ID: 2}}}},
		{"a batch inside", journalOp{Op: "batch", Ops: []journalOp{{Op: "del", ID: 1}, renameOver}}},
		{"a next inside", journalOp{Op: "batch", Ops: []journalOp{{Op: "del", ID: 1}, {Op: "next", ID: 99}}}},
		{"no id", journalOp{Op: "batch", Ops: []journalOp{{Op: "del", ID: 1}, {Op: "del"}}}},
	} {
		b := appendFrame(encodeJournal(testState(t, 2)), tc.op)
		recs, _, err := decodeJournal(b)
		var je *JournalError
		if !errors.As(err, &je) || len(recs) != 2 {
			t.Fatalf("%s: %d records, error %v; want both records and a JournalError", tc.name, len(recs), err)
		}
	}
}

func TestJournalCorrupt(t *testing.T) {
	b := encodeJournal(testState(t, 3))
	for i := len(journalMagic); i < len(b); i++ {
		c := append([]byte(nil), b...)
		c[i] ^= 0x40
		recs, _, err := decodeJournal(c)
		var je *JournalError
		if !errors.As(err, &je) {
			// A flip in a length can make a frame run to the end exactly
			// only by accident of sizes; anything else must be caught.
			t.Fatalf("flip at %d not detected (%d records)", i, len(recs))
		}
		if int(je.Offset) > i {
			t.Fatalf("flip at %d reported at %d, after it", i, je.Offset)
		}
	}
	if _, _, err := decodeJournal([]byte("not a journal")); err == nil {
		t.Fatal("a file without the magic decoded")
	}
}

func TestStateHoldsDescriptors(t *testing.T) {
	st := newState()
	fd, err := unix.MemfdCreate("t", unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	st.put(1, json.RawMessage(`{"id":1,"alloc":4096}`), fd, -1)
	if st.FDs() != 1 {
		t.Fatal("descriptor not held")
	}
	// A record saying the segment has no memory any more drops it.
	st.put(1, json.RawMessage(`{"id":1,"alloc":0}`), -1, -1)
	if st.FDs() != 0 || unix.Close(fd) == nil {
		t.Fatal("descriptor of a segment without memory kept open")
	}
	fd2, _ := unix.MemfdCreate("t", unix.MFD_CLOEXEC)
	st.put(2, json.RawMessage(`{"id":2,"alloc":4096}`), fd2, -1)
	st.del(2)
	if err := unix.Close(fd2); st.Len() != 1 || err == nil {
		t.Fatalf("after del: %d entries; the descriptor of a deleted segment kept open (close: %v)", st.Len(), err)
	}
}

func FuzzDecodeJournal(f *testing.F) {
	st := newState()
	st.put(1, json.RawMessage(`{"id":1,"name":"a","alloc":4096}`), -1, -1)
	f.Add(encodeJournal(st))
	f.Add(appendFrame([]byte(journalMagic), journalOp{Op: "del", ID: 3}))
	f.Add(appendFrame(encodeJournal(st), renameOver))
	f.Add([]byte(journalMagic))
	f.Fuzz(func(t *testing.T, b []byte) {
		recs, _, err := decodeJournal(b)
		for _, r := range recs {
			if !isObject(r) {
				t.Fatalf("decoded a record that is not an object: %q (err %v)", r, err)
			}
		}
	})
}
