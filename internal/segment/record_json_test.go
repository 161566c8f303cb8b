package segment

import (
	"bytes"
	"encoding/json"
	"math/rand/v2"
	"reflect"
	"testing"
)

// randomRecord fills every member of a Record, each left at its zero value
// half the time, so that every omission is tried both ways.
func randomRecord(r *rand.Rand, strs []string) Record {
	str := func() string {
		if r.IntN(2) == 0 {
			return ""
		}
		return strs[r.IntN(len(strs))]
	}
	num := func() int64 {
		if r.IntN(2) == 0 {
			return 0
		}
		return r.Int64N(1<<62) - 1<<61
	}
	flag := func() bool { return r.IntN(2) == 0 }
	rec := Record{
		ID: r.Uint64(), Name: str(), Linked: flag(), Size: num(), Alloc: num(), Device: int(num() % 8),
		UID: r.Uint32(), GID: r.Uint32(), Mode: r.Uint32N(0o7777), Created: num(), Modified: num(),
		TTL: num(), Idle: num(), InUse: flag(), Bound: flag(), Session: str(), CreatorPID: int(num() % (1 << 22)),
		CreatorStart: uint64(num() & (1<<40 - 1)), Origin: str(), PulledBy: str(), Orphan: str(), Slots: int(num() % 64), SlotBytes: num(),
		Uncommitted: flag(), CommitOrigin: str(), Version: uint64(num() & (1<<20 - 1)), Next: flag(), Tier: str(),
		Pin: flag(), Published: flag(), LastOpen: num(), Leases: flag(), Anon: int(num() % 100),
	}
	if flag() {
		replaces := uint64(num() & (1<<40 - 1))
		rec.Replaces = &replaces
	}
	if flag() {
		rec.Meta = json.RawMessage(`{ "model": "llama", "shards" : [1, 2, 3], "x": {"y": null} }`)
	}
	for range r.IntN(4) {
		rec.Holders = append(rec.Holders, Holder{PID: int(num() % (1 << 22)), Start: uint64(num() & (1<<40 - 1)), Session: uint64(num() & (1<<50 - 1)), N: int(num() % 1000)})
	}
	for range r.IntN(3) {
		rec.Parts = append(rec.Parts, Part{ID: uint64(num()), Size: num()})
	}
	if flag() {
		rec.PartOf = uint64(num())
	}
	rec.Foreign = num()%2 == 0
	for range num() % 3 {
		rec.Sources = append(rec.Sources, Source{Dev: uint64(num()), Ino: uint64(num()), Size: num(), MtimeNS: num(),
			CtimeNS: num(), Off: num(), At: num(), Len: num(), CRC32C: uint32(num())})
	}
	return rec
}

// The journal's encoder says what encoding/json says: byte for byte.
func TestRecordAppendJSON(t *testing.T) {
	strs := []string{"w", "llama-3-8b/layer.0", "5f2a/17", "quote \" and \\ back", "tab\tnew\nline",
		"<html> & co", "caf\u00e9 \u2028", "bad \xff utf-8", "\x00"}
	r := rand.New(rand.NewPCG(1, 2))
	for i := range 20000 {
		rec := randomRecord(r, strs)
		want, err := json.Marshal(rec)
		if err != nil {
			t.Fatal(err)
		}
		got := rec.AppendJSON([]byte("prefix"))
		if !bytes.Equal(got[len("prefix"):], want) {
			t.Fatalf("record %d:\n got %s\nwant %s", i, got[len("prefix"):], want)
		}
		var back Record
		if err := json.Unmarshal(got[len("prefix"):], &back); err != nil {
			t.Fatal(err)
		}
		if i == 0 && !reflect.DeepEqual(back.Holders, rec.Holders) {
			t.Fatalf("holders: got %+v, want %+v", back.Holders, rec.Holders)
		}
	}
}

func FuzzRecordAppendJSON(f *testing.F) {
	f.Add(uint64(1), "name", "session", int64(5), uint64(7), 3)
	f.Fuzz(func(t *testing.T, id uint64, name, session string, size int64, start uint64, n int) {
		rec := Record{ID: id, Name: name, Session: session, Size: size, Orphan: name + session,
			Holders: []Holder{{PID: n, Start: start, N: n}}, Leases: n%2 == 0}
		want, err := json.Marshal(rec)
		if err != nil {
			t.Skip()
		}
		if got := rec.AppendJSON(nil); !bytes.Equal(got, want) {
			t.Fatalf("got %s\nwant %s", got, want)
		}
	})
}

func BenchmarkRecordJSON(b *testing.B) {
	rec := Record{ID: 12, Name: "bench", Linked: true, Size: 2 << 20, Alloc: 2 << 20, UID: 1000, GID: 1000, Mode: 0o600,
		Created: 1764000000000000000, Modified: 1764000000000000000, Version: 1, LastOpen: 1764000000000000000,
		Leases: true, Holders: []Holder{{PID: 1234, Start: 99999, N: 1}}}
	b.Run("encoding/json", func(b *testing.B) {
		for b.Loop() {
			json.Marshal(rec)
		}
	})
	b.Run("AppendJSON", func(b *testing.B) {
		var buf []byte
		for b.Loop() {
			buf = rec.AppendJSON(buf[:0])
		}
	})
}
