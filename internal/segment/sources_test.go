package segment

import (
	"encoding/json"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/gpushm/gpushm/internal/crc32c"
	"github.com/gpushm/gpushm/internal/wire"
)

// sourcePart is a range of TestSources's file: off in the file, at in
// the segment, n bytes whose CRC-32C is crc.
func sourcePart(off, at, n int64, crc uint32) Source {
	s := Source{Dev: 8, Ino: 42, Size: 300, MtimeNS: 1, CtimeNS: 2}
	s.Off, s.At, s.Len, s.CRC32C = off, at, n, crc
	return s
}

// sourcesSetup is TestSources's registry, journal and allocator, with
// alice's segment "w" of 300 bytes and the mode given.
func sourcesSetup(t *testing.T, mode uint32) (*Registry, *fakeJournal, *fakeAlloc, *Segment) {
	t.Helper()
	f := newFake()
	r := New(f, nil)
	j := newJournal()
	r.SetJournal(j)
	s, _, err := r.Create(alice, CreateOptions{Name: "w", Size: 300, Mode: mode, UseMode: true})
	if err != nil {
		t.Fatal(err)
	}
	return r, j, f, s
}

// TestSources: the daemon's record of which bytes came from which file
// stands only while nobody it does not trust could have written them.
func TestSources(t *testing.T) {
	root := Cred{}
	part, setup := sourcePart, sourcesSetup
	sources := func(r *Registry) []Source {
		inf, err := r.Stat("w")
		if err != nil {
			t.Fatal(err)
		}
		return inf.Sources
	}

	t.Run("steps merge", func(t *testing.T) {
		r, j, f, s := setup(t, 0o644)
		a, b := crc32c.Checksum([]byte("ab")), crc32c.Checksum([]byte("c"))
		r.AddSource(alice, s, part(0, 0, 2, a))
		r.AddSource(alice, s, part(2, 2, 1, b))
		got := sources(r)
		if len(got) != 1 || got[0].Len != 3 || got[0].CRC32C != crc32c.Checksum([]byte("abc")) {
			t.Fatalf("two steps of one file = %+v, want one range of 3 with the CRC of both", got)
		}
		// Another state of the file is another source.
		other := part(3, 3, 5, 0)
		other.MtimeNS++
		r.AddSource(alice, s, other)
		if got := sources(r); len(got) != 2 {
			t.Fatalf("a changed file's range merged: %+v", got)
		}
		// They outlive a restart of the serving process.
		r2, _, _ := restart(t, f, j, time.Minute)
		if inf, _ := r2.Stat("w"); len(inf.Sources) != 2 {
			t.Fatalf("after a restart: %+v", inf.Sources)
		}
	})

	t.Run("writes the daemon sees", func(t *testing.T) {
		r := New(newDataAlloc(), nil)
		s, _, err := r.Create(alice, CreateOptions{Name: "w", Size: 300})
		if err != nil {
			t.Fatal(err)
		}
		r.AddSource(alice, s, part(0, 0, 100, 1))
		r.AddSource(alice, s, part(100, 200, 100, 2))
		if _, err := r.WriteAt(s, []byte("x"), 50); err != nil {
			t.Fatal(err)
		}
		if got := sources(r); len(got) != 1 || got[0].At != 200 {
			t.Fatalf("after a write at 50: %+v, want the range at 200 alone", got)
		}
		r.ForgetSources(s, 250, 1)
		if got := sources(r); len(got) != 0 {
			t.Fatalf("after a fill over it: %+v", got)
		}
		r.AddSource(alice, s, part(0, 0, 200, 1))
		if err := r.Resize(s, 100); err != nil {
			t.Fatal(err)
		}
		if got := sources(r); len(got) != 0 {
			t.Fatalf("after a truncate into it: %+v", got)
		}
	})

	t.Run("who may write", func(t *testing.T) {
		for _, tc := range []struct {
			name    string
			mode    uint32
			do      func(r *Registry, s *Segment) error
			foreign bool
		}{
			{"the owner opens read-write", 0o666, func(r *Registry, s *Segment) error { _, err := r.Acquire(alice, "w", false); return err }, false},
			{"root opens read-write", 0o600, func(r *Registry, s *Segment) error { _, err := r.Acquire(root, "w", false); return err }, false},
			{"another user opens read-only", 0o644, func(r *Registry, s *Segment) error { _, err := r.Acquire(bob, "w", true); return err }, false},
			{"another user opens read-write", 0o666, func(r *Registry, s *Segment) error { _, err := r.Acquire(bob, "w", false); return err }, true},
			{"another user writes through the view", 0o666, func(r *Registry, s *Segment) error { return r.Pin(bob, s, Write) }, true},
			{"root gives it away", 0o644, func(r *Registry, s *Segment) error { return r.SetOwner(root, s, int64(bob.UID), -1) }, true},
			{"the owner fills it", 0o644, func(r *Registry, s *Segment) error { r.Filling(alice, s); return nil }, false},
			{"root fills it", 0o644, func(r *Registry, s *Segment) error { r.Filling(root, s); return nil }, false},
			// Its copy runs beside the owner's, and their bytes interleave.
			{"another user fills it", 0o666, func(r *Registry, s *Segment) error { r.Filling(bob, s); return nil }, true},
		} {
			t.Run(tc.name, func(t *testing.T) {
				r, j, f, s := setup(t, tc.mode)
				r.AddSource(alice, s, part(0, 0, 300, 1))
				if err := tc.do(r, s); err != nil {
					t.Fatal(err)
				}
				if got := len(sources(r)) == 0; got != tc.foreign {
					t.Fatalf("sources gone = %v, want %v", got, tc.foreign)
				}
				// A foreign segment records nothing again, even after a
				// restart; the owner's fill is recorded otherwise.
				r.AddSource(alice, s, part(0, 0, 300, 1))
				if got := len(sources(r)) == 0; got != tc.foreign {
					t.Fatalf("after the owner's fill, sources gone = %v, want %v", got, tc.foreign)
				}
				if tc.foreign {
					r2, _, _ := restart(t, f, j, time.Minute)
					s2 := r2.byID[s.ID()]
					r2.AddSource(root, s2, part(0, 0, 300, 1))
					if inf, _ := r2.Stat("w"); len(inf.Sources) != 0 {
						t.Fatalf("a foreign segment took a source after a restart: %+v", inf.Sources)
					}
				}
			})
		}
	})

	t.Run("fills of others are not recorded", func(t *testing.T) {
		r, _, _, s := setup(t, 0o666)
		r.AddSource(bob, s, part(0, 0, 300, 1))
		if got := sources(r); len(got) != 0 {
			t.Fatalf("another user's fill recorded: %+v", got)
		}
	})
}

// TestSourcesFitAMessage: a segment with the most sources, each of the
// largest numbers, and the most meta still journals in one record of at
// most a protocol message, which the supervisor's link takes (two of them
// in a batch); any user could make one.
func TestSourcesFitAMessage(t *testing.T) {
	r := New(newFake(), nil)
	j := newJournal()
	r.SetJournal(j)
	meta, _ := json.Marshal(map[string]string{"x": strings.Repeat("y", wire.MaxMeta-8)})
	if len(meta) != wire.MaxMeta {
		t.Fatalf("meta of %d bytes, want %d", len(meta), wire.MaxMeta)
	}
	s, _, err := r.Create(alice, CreateOptions{Name: strings.Repeat("n", MaxName), Size: 1 << 20, Meta: meta})
	if err != nil {
		t.Fatal(err)
	}
	for i := range int64(MaxSources + 1) {
		r.AddSource(alice, s, Source{Dev: math.MaxUint64, Ino: math.MaxUint64, Size: math.MaxInt64,
			MtimeNS: math.MinInt64, CtimeNS: math.MinInt64, Off: math.MaxInt64 - 2*i - 1, At: math.MaxInt64 - 2*i - 1, Len: 1, CRC32C: math.MaxUint32})
	}
	rec := j.recs[s.ID()]
	if len(rec.Sources) != MaxSources {
		t.Fatalf("%d sources recorded, want %d", len(rec.Sources), MaxSources)
	}
	if n := len(rec.AppendJSON(nil)); n > wire.MaxMessage {
		t.Fatalf("the record is %d bytes, over the %d of a message", n, wire.MaxMessage)
	}
}

// cudaAlloc is the fake allocator with the cuda backend's handle type,
// whose descriptors carry no access mode.
type cudaAlloc struct{ *fakeAlloc }

func (cudaAlloc) HandleType() string { return handleCUDA }

// TestSourcesOnCUDA: on cuda a read-only open is write access, since its
// holder may map the export read-write.
func TestSourcesOnCUDA(t *testing.T) {
	if handleCUDA != wire.HandleCUDA {
		t.Fatalf("handleCUDA = %q, want %q", handleCUDA, wire.HandleCUDA)
	}
	file := Source{Dev: 8, Ino: 42, Size: 300, MtimeNS: 1, CtimeNS: 2, Len: 300}
	for _, tc := range []struct {
		name    string
		who     Cred
		foreign bool
	}{
		{"the owner", alice, false},
		{"root", Cred{}, false},
		{"another user", bob, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := New(cudaAlloc{newFake()}, nil)
			s, _, err := r.Create(alice, CreateOptions{Name: "w", Size: 300, Mode: 0o644, UseMode: true})
			if err != nil {
				t.Fatal(err)
			}
			r.AddSource(alice, s, file)
			if _, err := r.Acquire(tc.who, "w", true); err != nil {
				t.Fatal(err)
			}
			inf, _ := r.Stat("w")
			if got := len(inf.Sources) == 0; got != tc.foreign {
				t.Fatalf("after a read-only open by %s, sources gone = %v, want %v", tc.name, got, tc.foreign)
			}
		})
	}
}
