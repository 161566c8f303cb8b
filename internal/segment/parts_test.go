package segment

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

// partedAlloc is a spill allocator whose memory comes in three parts, as
// backend.Spill makes large spill memory.
type partedAlloc struct{ *fakeAlloc }

type partedMem struct {
	*fakeMem
	parts []Memory
}

func (m *partedMem) Parts() []Memory { return m.parts }
func (m *partedMem) Free() error {
	for _, p := range m.parts {
		p.Free()
	}
	return nil
}

func (a partedAlloc) Allocate(device int, size int64) (Memory, error) {
	return a.AllocateScratch(device, size, 3)
}

// AllocateScratch makes three parts, or as many as parts allows.
func (a partedAlloc) AllocateScratch(device int, size int64, parts int) (Memory, error) {
	n := min(parts, 3)
	if n < 2 {
		return a.fakeAlloc.Allocate(device, size)
	}
	m := &partedMem{fakeMem: &fakeMem{f: a.fakeAlloc}}
	for range n {
		p, err := a.fakeAlloc.Allocate(device, (size+int64(n)-1)/int64(n))
		if err != nil {
			return nil, err
		}
		m.parts = append(m.parts, p)
		m.size += p.Size()
	}
	m.fd = m.parts[0].(*fakeMem).fd
	return m, nil
}

// TestJournalParts: memory in parts (Parted) is journaled as one record
// per part beyond the first, each with its descriptor, before the
// segment's own record lists them; memory that replaces it has the
// journal forget them after the segment's record stops naming them; a
// removal forgets them; and a part that no segment names at a restart is
// freed and forgotten.
func TestJournalParts(t *testing.T) {
	f := newTiers(t, 100, 100)
	spill := partedAlloc{f.spill}
	f.r.SetTiers(Tiers{Budgets: map[int]int64{0: f.budget}, HostBudget: f.host, Spill: spill, Mover: f.mover})
	j := newJournal()
	f.r.SetJournal(j)
	if _, _, err := f.r.Create(alice, CreateOptions{Name: "w", Size: 3 * page}); err != nil {
		t.Fatal(err)
	}
	j.take()
	if _, err := f.r.Evict(alice, "w"); err != nil {
		t.Fatal(err)
	}
	id := f.r.mustID(t, "w")
	log := j.take()
	if len(log) != 3 || log[0] != "put  linked=false fd=true" || log[1] != log[0] || log[2] != "put w linked=true fd=true" {
		t.Fatalf("journaled %q, want the two parts with their descriptors, then the segment", log)
	}
	rec := j.recs[id]
	if len(rec.Parts) != 3 || rec.Parts[0].ID != id || rec.Tier != "host" {
		t.Fatalf("the segment's record: %+v, want three parts, the first its own", rec)
	}
	for _, p := range rec.Parts[1:] {
		pr, ok := j.recs[p.ID]
		if !ok || pr.PartOf != id || pr.Alloc != p.Size || pr.Linked || j.fds[p.ID] <= 0 {
			t.Fatalf("part %d: record %+v, descriptor %d", p.ID, pr, j.fds[p.ID])
		}
	}

	// A replay to a keeper that took over (a new supervisor) puts the
	// parts again under the same records: one that had them already from
	// an eviction that ended after it took over holds each once.
	jr := newJournal()
	jr.recs[rec.Parts[1].ID] = j.recs[rec.Parts[1].ID]
	f.r.SetJournal(jr)
	f.r.Replay()
	if len(jr.recs) != 3 || !slices.Equal(jr.recs[id].Parts, rec.Parts) {
		t.Fatalf("replayed: %v, want the segment and the same two parts", jr.recs)
	}
	f.r.SetJournal(j)

	// Back on the device: the segment's record first, then the parts go.
	if _, err := f.r.Load(alice, "w"); err != nil {
		t.Fatal(err)
	}
	log = j.take()
	if len(log) != 3 || !strings.HasPrefix(log[0], "put w") || log[1] != "del " || log[2] != "del " {
		t.Fatalf("restore journaled %q, want the segment, then both parts forgotten", log)
	}
	if len(j.recs[id].Parts) != 0 || len(j.recs) != 1 {
		t.Fatalf("after the restore the journal holds %v", j.recs)
	}

	// Evicted again (a swap: the clean copy), then a restart that joins
	// the parts (as the daemon's restore does) and finds another that no
	// record names (a crash between a part's record and its segment's):
	// that one is freed, and the journal forgets it.
	if _, err := f.r.Evict(alice, "w"); err != nil {
		t.Fatal(err)
	}
	j.take()
	rec = j.recs[id]
	if len(rec.Parts) != 3 {
		t.Fatalf("evicted again: %+v, want three parts", rec)
	}
	stray, err := f.spill.Allocate(0, page)
	if err != nil {
		t.Fatal(err)
	}
	strayFD, _ := stray.FD()
	joined := &partedMem{fakeMem: &fakeMem{f: f.spill, fd: j.fds[id], size: rec.Alloc}}
	for _, p := range rec.Parts {
		joined.parts = append(joined.parts, &fakeMem{f: f.spill, fd: j.fds[p.ID], size: p.Size})
	}
	r2 := New(f.dev, nil)
	j2 := newJournal()
	r2.SetJournal(j2)
	live := f.spill.liveCount()
	r2.Restore([]Restored{{Record: rec, Memory: joined},
		{Record: Record{ID: 999, PartOf: id, Alloc: page, Tier: "host"}, Memory: &fakeMem{f: f.spill, fd: strayFD, size: page}}}, 0, time.Second)
	if log := j2.take(); len(log) != 1 || log[0] != "del " {
		t.Fatalf("restore journaled %q, want the stray part forgotten", log)
	}
	if n := f.spill.liveCount(); n != live-1 {
		t.Fatalf("%d spill allocations live after the restart, want %d: the stray part freed", n, live-1)
	}
	// The joined parts are the segment's: a removal forgets all three.
	if err := r2.Unlink(alice, "w"); err != nil {
		t.Fatal(err)
	}
	log = j2.take()
	slices.Sort(log)
	if want := []string{"del ", "del ", "del "}; !slices.Equal(log, want) {
		t.Fatalf("removal journaled %q, want %q", log, want)
	}
	if n := f.spill.liveCount(); n != live-1-3 {
		t.Fatalf("%d spill allocations live after the removal, want %d", n, live-4)
	}
}

// TestSpillPartsWithinLimits: memory in parts counts one descriptor a part
// against the daemon's limit of descriptors (clean copies in parts too),
// and an eviction takes parts only within a quarter of the room left under
// that limit, with the parts beyond the first of all segments, clean
// copies and evictions under way at most an eighth of it; evictions at
// once, each choosing while the others copy, stay within it together.
func TestSpillPartsWithinLimits(t *testing.T) {
	f := newTiers(t, 1000, 1000)
	f.r.SetTiers(Tiers{Budgets: map[int]int64{0: f.budget}, HostBudget: f.host, Spill: partedAlloc{f.spill}, Mover: f.mover})
	f.r.SetLimits(Limits{Segments: 40})
	held := func() int {
		f.r.mu.Lock()
		defer f.r.mu.Unlock()
		n := 0
		f.r.eachHeldLocked(func(_ *Segment, _ int64, d int) { n += d })
		return n
	}
	for _, name := range []string{"a", "b", "c"} {
		if _, _, err := f.r.Create(Root, CreateOptions{Name: name, Size: 3 * page}); err != nil {
			t.Fatal(err)
		}
	}
	// An eighth of 40 is 5 parts beyond the first: a and b take 2 each,
	// c one memfd (a second part alone would be 1 more).
	for _, c := range []struct {
		name string
		want int
	}{{"a", 3}, {"b", 3}, {"c", 2}} {
		if _, err := f.r.Evict(Root, c.name); err != nil {
			t.Fatal(err)
		}
		if n := mustSeg(t, f.r, c.name).descriptors(); n != c.want {
			t.Fatalf("%s, evicted: %d descriptors, want %d", c.name, n, c.want)
		}
	}
	// Creates fill the limit, parts counted.
	for i := held(); i < 40; i++ {
		if _, _, err := f.r.Create(Root, CreateOptions{Name: fmt.Sprintf("s%d", i), Size: page}); err != nil {
			t.Fatalf("create with %d descriptors of 40 held: %v", held(), err)
		}
	}
	if _, _, err := f.r.Create(Root, CreateOptions{Name: "over", Size: page}); !errors.Is(err, ErrQuota) {
		t.Fatalf("a create past the limit, with parts counted: %v", err)
	}
	// A restore keeps a clean copy in parts only where the limit has room
	// for its parts: here it has none, and the copy goes.
	if _, err := f.r.Load(Root, "a"); err != nil {
		t.Fatal(err)
	}
	if s := mustSeg(t, f.r, "a"); s.descriptors() != 1 || held() > 40 {
		t.Fatalf("a, back: %d descriptors, %d held of 40", s.descriptors(), held())
	}
	// No room now: one memfd.
	if _, err := f.r.Evict(Root, "a"); err != nil {
		t.Fatal(err)
	}
	if n := mustSeg(t, f.r, "a").descriptors(); n != 1 {
		t.Fatalf("a, evicted with no room left: %d descriptors, want 1", n)
	}

	// Eight evictions at once, each copy slow: together within the limit.
	g := newTiers(t, 1000, 1000)
	g.r.SetTiers(Tiers{Budgets: map[int]int64{0: g.budget}, HostBudget: g.host, Spill: partedAlloc{g.spill}, Mover: g.mover})
	g.r.SetLimits(Limits{Segments: 24})
	g.mover.delay = 20 * time.Millisecond
	var wg sync.WaitGroup
	for i := range 8 {
		name := fmt.Sprintf("e%d", i)
		if _, _, err := g.r.Create(Root, CreateOptions{Name: name, Size: 3 * page}); err != nil {
			t.Fatal(err)
		}
		wg.Go(func() {
			if _, err := g.r.Evict(Root, name); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	n := 0
	g.r.mu.Lock()
	g.r.eachHeldLocked(func(_ *Segment, _ int64, d int) { n += d })
	g.r.mu.Unlock()
	if n > 8+24/8 {
		t.Fatalf("8 segments evicted at once hold %d descriptors: more than 8 and an eighth of the limit of 24", n)
	}
}
