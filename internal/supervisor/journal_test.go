package supervisor

import (
	"encoding/json"
	"errors"
	"fmt"
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

func TestJournalRoundTrip(t *testing.T) {
	st := testState(t, 5)
	b := encodeJournal(st)
	b = appendFrame(b, journalOp{Op: "del", ID: 2})
	b = appendFrame(b, journalOp{Op: "put", ID: 6, Rec: json.RawMessage(`{"id":6}`)})
	recs, next, err := decodeJournal(b)
	if err != nil {
		t.Fatal(err)
	}
	if len(recs) != 5 || recs[2] != nil || string(recs[6]) != `{"id":6}` || next != 15 {
		t.Fatalf("decoded %d records (2: %s, 6: %s), next %d", len(recs), recs[2], recs[6], next)
	}
}

// Every truncation of a journal reads as the records of the frames that
// are whole, and one that cuts a frame says where; none panics or invents
// a record.
func TestJournalTruncated(t *testing.T) {
	b := encodeJournal(testState(t, 3))
	whole, _, _ := decodeJournal(b)
	boundaries := map[int]bool{len(journalMagic): true}
	for off := len(journalMagic); off < len(b); {
		off += 8 + int(b[off]) | int(b[off+1])<<8
		boundaries[off] = true
	}
	for n := len(journalMagic); n < len(b); n++ {
		recs, _, err := decodeJournal(b[:n])
		if (err == nil) != boundaries[n] {
			t.Fatalf("cut at %d: error %v", n, err)
		}
		for id, rec := range recs {
			if string(whole[id]) != string(rec) {
				t.Fatalf("cut at %d: record %d is %s, want %s", n, id, rec, whole[id])
			}
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
