package backend

import (
	"context"
	"fmt"
	"log/slog"
	"runtime"
	"sync"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm/internal/segment"
)

// The spill reserve: host memory made ahead of evictions (Spill.Reserve).
// A first eviction into new memory waits for the kernel to make and zero
// every page of it (4 KiB pages, where shmem has no transparent huge
// pages): 3.8 to 4.4 GB/s for 16 GiB on an H100 or H200 machine, where the
// copy into pages that exist runs at 49 GB/s. The reserve makes the pages
// before they are needed, in the background, and an eviction takes them.
//
// It is a few memfds (pieces): one of four fifths of the reserve, and the
// fifth left in pieces of halving sizes, half of it, a quarter, ..., down
// to a 256th of the reserve (at least 2 MiB), the smallest twice: ten
// descriptors at most, whatever the size. A segment's memory is one memfd,
// so an eviction takes one piece whole: the smallest ready that holds it
// and is at most 8 times its size (an eviction of a few MiB would waste a
// piece of GiBs; it makes its own memory, a few milliseconds). The largest
// eviction the reserve serves is four fifths of it, which the default
// sizes to the largest GPU budget (at most a seventh of host memory): the
// first eviction of a segment that large is the one a user meets first and
// waits for longest (4.2 s for 16 GiB into new memory on an H200 machine).
// Smaller ones take the small pieces (the next is an eighth of the
// largest: no size between finds none); two large evictions at once find
// one piece for the first only.
//
// A piece is made as Spill.Allocate makes memory (a sealed memfd, its
// pages made by MADV_POPULATE_WRITE in the daemon's mapping, which the
// eviction's copy then writes through without a fault), but on threads of
// the lowest priority (nice 19), a few MiB at a time so that the daemon's
// memory map lock is never held long, smallest piece first, and not within
// a second of an eviction taking one (the copy needs the memory's
// bandwidth). Pieces are sealed when made, and the piece taken keeps its
// size: its tail past the eviction's bytes is punched out
// (FALLOC_FL_PUNCH_HOLE) in the background. A truncation would free those
// pages on the eviction's path (it must come before the seal, which the
// memory needs before it is journaled), a time that grows with the tail.
//
// Huge pages: where the machine has hugetlb pages free (HugePages_Free
// less HugePages_Rsvd, /proc/meminfo) for a whole piece, the piece is a
// hugetlbfs memfd (MFD_HUGETLB); else, where shmem may have transparent
// huge pages (/sys/kernel/mm/transparent_hugepage/shmem_enabled other than
// never or deny), its mapping is advised MADV_HUGEPAGE. Spill memory never
// leaves the daemon (an open restores a segment first; the FUSE view uses
// the daemon's mapping), so only the daemon maps a hugetlbfs memfd, in
// whole huge pages (mapLength), also once restored after a restart.
//
// It is not pinned (cuMemHostRegister): the cuda backend copies through
// its own pinned buffers at the copy engine's speed (49 GB/s into host
// memory whose pages exist), so pinning would buy no measurable speed and
// would lock memory the kernel could not reclaim.
//
// Under memory pressure it gives memory back: checked every second,
// MemAvailable below a sixteenth of host memory (at least 1 GiB) frees
// pieces of ordinary memory (hugetlb pages do not count in MemAvailable),
// enough to bring it back to twice that; a piece is made only while
// MemAvailable stays above twice that once it is made. In a memory cgroup
// with a limit, the room left under the limit counts where it is less,
// and the threshold is a sixteenth of the limit where that is less (at
// least 1 GiB still: a container of 512 MiB gets no reserve).

// reserveMaxWaste bounds the piece an allocation may take: at most this
// many times its size.
const reserveMaxWaste = 8

// fits says whether a piece of n bytes may serve an allocation of size
// bytes: it holds it, and is at most reserveMaxWaste times it.
func fits(n, size int64) bool { return n >= size && n <= reserveMaxWaste*size }

// reserveBigShare: the largest piece is all of the reserve but one part
// in this many (four fifths); the rest is the smaller pieces, the first of
// them an eighth of the largest, so that every size up to the largest
// finds a piece at most reserveMaxWaste times it.
const reserveBigShare = 5

// reserveChunk is what one thread populates at a time for the reserve:
// the daemon's memory map lock is held for that long.
const reserveChunk = 4 << 20

// reserve is the host memory Spill keeps made ahead.
type reserve struct {
	// sizes is each piece's size: the layout's, largest first, then the
	// demand's slot (SetDemand; 0 while nothing asks for more).
	sizes []int64
	align int64
	low   int64 // MemAvailable under which pieces are given back

	mu     sync.Mutex
	pieces []*piece // by slot of sizes; nil while not made
	closed bool
	// making is the slot whose piece is being made, -1 for none; made is
	// closed once it is made or given up; waiting counts the evictions
	// that wait for it.
	making  int
	made    chan struct{}
	waiting int
	// pending is the demand seen since pendingSince, not yet made a
	// piece of (grow); freed is when grow last freed the demand's piece.
	pending      int64
	pendingSince time.Time
	freed        time.Time
	lastTake     time.Time
	takes        uint64
	takenBytes   int64
	// punching counts the tails of taken pieces being punched out; added
	// to under mu while not closed, so that close can wait for it.
	punching sync.WaitGroup
}

// piece is one memfd of the reserve, its pages made. It is not mapped
// while it waits: a serving process that is killed tears its mappings
// down before it can be reaped, and its successor waits for that (0.8 s
// for 16 GiB of mapped pages on an H200 machine; Keeper says more). The
// eviction that takes it maps it (mapPiece).
type piece struct {
	fd   int
	n    int64
	huge bool // hugetlbfs
	thp  bool // its pages were made through a mapping advised MADV_HUGEPAGE
	// keeper holds a reference to it under id while it is the reserve's
	// (Keeper); nil when none does.
	keeper Keeper
	id     uint64
}

func (p *piece) size() int64 { return p.n }

// unkeep ends the keeper's hold: the piece is freed, or becomes a
// segment's memory.
func (p *piece) unkeep() {
	if p.keeper != nil {
		p.keeper.Unhold(p.id)
		p.keeper = nil
	}
}

func (p *piece) free() {
	// Its pages are freed here, by the reserve's goroutine: freed by the
	// last close, that would be the keeper's, and a supervisor freeing
	// 40 GiB takes seconds it owes the records of evictions.
	unix.Fallocate(p.fd, unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, 0, p.n)
	p.unkeep()
	unix.Close(p.fd)
}

// A Keeper holds references to the reserve's memory in another process,
// the supervisor (supervisor.Link), so that a serving process that is
// killed does not free the reserve on its way out: the kernel frees a
// process's memory before the process can be reaped, and a supervisor
// starts the successor only once it has reaped it. With 16 GiB of reserve
// that made SIGKILL to serving again 2.2 to 3.3 s instead of 0.35 s (an
// H200 machine, 128 GiB); held elsewhere, the dying process only drops its
// references, and the keeper frees the memory later.
type Keeper interface {
	// Hold keeps a reference to fd (the caller keeps its own) under id.
	Hold(id uint64, fd int)
	// Unhold drops the reference held under id.
	Unhold(id uint64)
}

// SetKeeper has k hold the reserve's pieces (Keeper). Call it before
// Reserve.
func (s *Spill) SetKeeper(k Keeper) { s.keeper = k }

// SetDemand grows the reserve on demand: f says how much host memory the
// next eviction may need (the largest segment on a GPU that has no copy
// in host memory yet), and while that is more than the layout's largest
// piece, the reserve makes one more piece of that size, checked as often
// as memory pressure is. A first eviction of a segment larger than the
// layout serves is then a copy at the copy engine's speed too, once the
// piece is made (fresh host memory is made at 4 to 5 GB/s on an H100
// machine, 128 GiB, without transparent huge pages for shmem: the piece
// of 24 GiB takes about 6 s). Call it before Reserve.
func (s *Spill) SetDemand(f func() int64) { s.demand = f }

// reserveLayout is the pieces' sizes for a reserve of total bytes, each a
// multiple of align, largest first (see above).
func reserveLayout(total, align int64) []int64 {
	least := max(total/256/align*align, align)
	var sizes []int64
	rem := total
	if big := total / reserveBigShare * (reserveBigShare - 1) / align * align; big >= least {
		sizes = append(sizes, big)
		rem -= big
	}
	for rem >= 2*least {
		p := rem / 2 / align * align
		sizes = append(sizes, p)
		rem -= p
	}
	if p := rem / align * align; p > 0 {
		sizes = append(sizes, p)
	}
	return sizes
}

// Reserve keeps up to size bytes of host memory made ahead for spill
// allocations (evictions, and evicted segments that grow) until ctx is
// done, then frees it, and returns once nothing it started runs. Call it
// once, in a goroutine of its own, once the daemon serves.
func (s *Spill) Reserve(ctx context.Context, size int64, log *slog.Logger) {
	mi, err := s.meminfo()
	if err != nil {
		log.Warn("no host reserve: cannot read the kernel's memory figures", "err", err)
		return
	}
	// Pieces of whole huge pages (2 MiB, or the hugetlb size where the
	// machine has hugetlb pages and the reserve is several of them).
	align := int64(2 << 20)
	if mi.hugeTotal > 0 && size >= 4*mi.hugePage {
		align = max(align, mi.hugePage)
	}
	// The threshold is a share of the memory this process may use: the
	// host's, or its cgroup's limit.
	total := s.host.total
	if mi.limit > 0 {
		total = min(total, mi.limit)
	}
	r := &reserve{sizes: reserveLayout(size, align), align: align, low: max(total/16, 1<<30), making: -1}
	if len(r.sizes) == 0 {
		return
	}
	log.Info("host reserve", "bytes", r.target(), "pieces", len(r.sizes), "largest", r.sizes[0],
		"hugetlb_free_bytes", mi.hugeAvail, "shmem_thp", shmemTHP(), "pressure_below_bytes", r.low,
		"on_demand", s.demand != nil)
	r.sizes = append(r.sizes, 0) // the demand's slot
	r.pieces = make([]*piece, len(r.sizes))
	s.res.Store(r)
	thp := shmemTHP()
	tick := time.NewTicker(s.every)
	defer tick.Stop()
	for {
		s.relieve(r, log)
		s.fill(ctx, r, thp, log)
		select {
		case <-ctx.Done():
			s.res.Store(nil)
			r.close()
			return
		case <-tick.C:
		}
	}
}

// target is the bytes the reserve holds when full; r.mu is held, or
// the reserve not yet shared.
func (r *reserve) target() int64 {
	var n int64
	for _, s := range r.sizes {
		n += s
	}
	return n
}

// grow sizes the demand's slot to what SetDemand's function asks now:
// none while the layout's largest piece would serve it; a piece made for
// an earlier demand stays while it serves this one (reserveMaxWaste),
// and is freed otherwise.
func (s *Spill) grow(r *reserve, log *slog.Logger) {
	if s.demand == nil {
		return
	}
	want := s.demanded(r)
	d := len(r.sizes) - 1
	r.mu.Lock()
	p := r.pieces[d]
	if p != nil && want > 0 && fits(p.size(), want) {
		want = p.size()
	}
	// A new piece only for a demand that held for demandSteady, and not
	// within demandRest of freeing one: a user who makes and removes
	// large segments in a loop must not keep the daemon making and
	// freeing host memory.
	now := time.Now()
	if want > 0 && want != r.sizes[d] {
		if r.pending != want {
			r.pending, r.pendingSince = want, now
		}
		if now.Sub(r.pendingSince) < demandSteady*s.every || now.Sub(r.freed) < demandRest*s.every {
			want = 0
		}
	}
	if want == r.sizes[d] {
		r.mu.Unlock()
		return
	}
	r.sizes[d], r.pieces[d] = want, nil
	if p != nil {
		r.freed = now
	}
	r.mu.Unlock()
	if p != nil {
		p.free()
	}
	log.Debug("host reserve: on demand", "bytes", want)
}

// demanded is what SetDemand's function asks now, in whole pieces; 0
// where the layout's largest piece serves it.
func (s *Spill) demanded(r *reserve) int64 {
	want := (s.demand() + r.align - 1) / r.align * r.align
	if want <= r.sizes[0] || partsFor(want) > 1 {
		// Or spill memory in parts serves it (AllocateScratch), which
		// the kernel makes as fast as a piece made ahead is copied into
		// (24 GiB at 23.8 GB/s on an H200 machine), with nothing held
		// while the node idles; a piece made beside such an eviction
		// slowed it to 8.7 GB/s at 60 GiB.
		return 0
	}
	return want
}

// wants says whether a piece of size bytes still serves the demand.
func (s *Spill) wants(r *reserve, size int64) bool {
	want := s.demanded(r)
	return want > 0 && fits(size, want)
}

// demandSteady and demandRest, in intervals of Spill.every: a demand
// holds this long before its piece is made, and none is made within
// demandRest of freeing one.
const (
	demandSteady = 2
	demandRest   = 10
)

// fill makes the pieces missing while memory allows: the demand's first
// (an eviction of that size is the one in sight), then the layout's,
// smallest first.
func (s *Spill) fill(ctx context.Context, r *reserve, thp bool, log *slog.Logger) {
	skip := map[int]bool{} // no room for them on this pass
	for {
		// A demand that came while the last piece was made comes next.
		s.grow(r, log)
		i, size := r.missing(skip)
		if i < 0 {
			return
		}
		mi, err := s.meminfo()
		if err != nil {
			return
		}
		demand := i == len(r.sizes)-1
		// The demand's piece is ordinary memory: a user's segment must not
		// have the daemon take the machine's hugetlb pages, which nothing
		// gives back under pressure.
		huge := !demand && mi.hugeAvail >= size && mi.hugePage > 0 && size%mi.hugePage == 0
		room := mi.available-size >= 2*r.low
		var wanted func() bool
		if demand {
			wanted = func() bool { return s.wants(r, size) }
		}
		if !huge && !room {
			skip[i] = true
			continue
		}
		start := time.Now()
		r.mu.Lock()
		r.making, r.made = i, make(chan struct{})
		r.mu.Unlock()
		var p *piece
		if huge {
			p, err = makePiece(size, mi.hugePage, thp, s.more(ctx, r, true, nil), s.keeper, s.pieceIDs.Add(1))
			if err != nil && ctx.Err() == nil {
				log.Debug("host reserve: no hugetlb piece", "bytes", size, "err", err)
			}
		}
		if p == nil && room && ctx.Err() == nil {
			p, err = makePiece(size, 0, thp, s.more(ctx, r, false, wanted), s.keeper, s.pieceIDs.Add(1))
		}
		r.mu.Lock()
		r.making = -1
		close(r.made)
		if p == nil || r.closed {
			r.mu.Unlock()
			if p != nil {
				p.free()
			}
			// Not made: an error, or stopped (ctx done, or memory short).
			if err != nil && ctx.Err() == nil {
				log.Debug("host reserve: piece not made", "bytes", size, "err", err)
			}
			return
		}
		r.pieces[i] = p
		r.mu.Unlock()
		log.Debug("host reserve: piece made", "bytes", size, "hugetlb", p.huge, "seconds", time.Since(start).Seconds())
	}
}

// missing is the slot to make next and its size: the demand's, then the
// layout's, smallest first, but those in skip; -1 when none is missing.
func (r *reserve) missing(skip map[int]bool) (int, int64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for i := len(r.sizes) - 1; i >= 0; i-- {
		if r.pieces[i] == nil && r.sizes[i] > 0 && !skip[i] {
			return i, r.sizes[i]
		}
	}
	return -1, 0
}

// more is asked before each chunk of a piece being made: unless an
// eviction waits for the piece, it waits while an eviction took a piece
// within the last interval or makes new memory; it says no once ctx is
// done, for ordinary memory once memory is short, and once wanted (if
// set) says the piece is no longer wanted.
func (s *Spill) more(ctx context.Context, r *reserve, huge bool, wanted func() bool) func() bool {
	var (
		mu      sync.Mutex
		checked time.Time
		short   bool
	)
	return func() bool {
		for {
			r.mu.Lock()
			wait := s.every - time.Since(r.lastTake)
			waiting := r.waiting
			r.mu.Unlock()
			if waiting > 0 {
				// An eviction waits for this piece: no pause of its own.
				break
			}
			if s.making.Load() > 0 {
				// An eviction makes new memory: as fast alone as the two
				// together.
				wait = max(wait, s.every/10)
			}
			if wait <= 0 {
				break
			}
			t := time.NewTimer(wait)
			select {
			case <-ctx.Done():
				t.Stop()
				return false
			case <-t.C:
			}
		}
		if ctx.Err() != nil {
			return false
		}
		mu.Lock()
		defer mu.Unlock()
		if !short && time.Since(checked) >= s.every {
			checked = time.Now()
			if mi, err := s.meminfo(); !huge && err == nil && mi.available < r.low {
				short = true
			}
			if wanted != nil && !wanted() {
				short = true // its segment went: stop making it
			}
		}
		return !short
	}
}

// relieve gives back pieces of ordinary memory while MemAvailable is
// below the reserve's threshold: enough to bring it up to twice that, the
// smallest piece that is enough, else the largest, and again.
func (s *Spill) relieve(r *reserve, log *slog.Logger) {
	mi, err := s.meminfo()
	if err != nil || mi.available >= r.low {
		return
	}
	need := 2*r.low - mi.available
	var freed []*piece
	r.mu.Lock()
	for need > 0 {
		best := -1
		for i, p := range r.pieces {
			if p == nil || p.huge {
				continue
			}
			if best < 0 {
				best = i
				continue
			}
			b := r.pieces[best]
			switch {
			case p.size() >= need && (b.size() < need || p.size() < b.size()):
				best = i
			case p.size() < need && b.size() < need && p.size() > b.size():
				best = i
			}
		}
		if best < 0 {
			break
		}
		freed = append(freed, r.pieces[best])
		need -= r.pieces[best].size()
		r.pieces[best] = nil
	}
	r.mu.Unlock()
	if len(freed) == 0 {
		return
	}
	var n int64
	for _, p := range freed {
		n += p.size()
		p.free()
	}
	log.Info("host reserve: gave memory back under memory pressure", "bytes", n,
		"available_bytes", mi.available, "threshold_bytes", r.low)
}

// take takes the smallest piece ready that fits size bytes, or nil; and
// then, with wait set, if the piece being made would fit, a channel
// closed once it is made or given up, with r.waiting counted up (the
// caller counts it down). With tail set, the caller must punch out what
// lies past size and then call r.punching.Done.
func (r *reserve) take(size int64, wait bool) (p *piece, tail bool, made <-chan struct{}) {
	r.mu.Lock()
	defer r.mu.Unlock()
	best := -1
	for i, p := range r.pieces {
		if p == nil || !fits(p.size(), size) {
			continue
		}
		if best < 0 || p.size() < r.pieces[best].size() {
			best = i
		}
	}
	if r.closed {
		return nil, false, nil
	}
	if best < 0 {
		if wait && r.making >= 0 && fits(r.sizes[r.making], size) {
			r.waiting++
			return nil, false, r.made
		}
		return nil, false, nil
	}
	p = r.pieces[best]
	r.pieces[best] = nil
	r.lastTake = time.Now()
	r.takes++
	r.takenBytes += size
	if p.size() > size {
		r.punching.Add(1)
		tail = true
	}
	return p, tail, nil
}

// close frees every piece and waits for the tails being punched out.
func (r *reserve) close() {
	r.mu.Lock()
	r.closed = true
	ps := r.pieces
	r.pieces = make([]*piece, len(ps))
	r.mu.Unlock()
	for _, p := range ps {
		if p != nil {
			p.free()
		}
	}
	r.punching.Wait()
}

// fromReserve is size bytes (a multiple of the page size) of the reserve,
// or nil. rate is how fast the caller would make new memory otherwise,
// in bytes a second: it waits for a piece being made no longer than that
// would take; 0 takes only a piece made already.
func (s *Spill) fromReserve(size, rate int64) *hostMemory {
	r := s.res.Load()
	if r == nil {
		return nil
	}
	p, tail, made := r.take(size, rate > 0)
	if made != nil {
		// A piece that would serve is being made: waiting for it beats
		// making memory beside it, which halves the speed of both (an
		// eviction of 24 GiB took 11.3 s so, instead of 6.3 s alone), up to
		// what new memory would take.
		t := time.NewTimer(time.Duration(float64(size) / float64(rate) * float64(time.Second)))
		select {
		case <-made:
		case <-t.C:
		}
		t.Stop()
		r.mu.Lock()
		r.waiting--
		r.mu.Unlock()
		// Once: if another piece that would serve is being made now, this
		// eviction has waited its turn.
		p, tail, _ = r.take(size, false)
	}
	if p == nil {
		return nil
	}
	// A segment's memory now: the supervisor gets it with its record.
	p.unkeep()
	m := &hostMemory{fd: p.fd, size: size, recycle: s.recycle}
	if b, err := mapPiece(p, size); err == nil {
		m.view.b = b
	} // else its first copy maps it (hostMemory.bytes)
	if tail {
		// Through a descriptor of its own: m may be freed, and its
		// number given to another file, before the punch.
		dup, err := unix.FcntlInt(uintptr(p.fd), unix.F_DUPFD_CLOEXEC, 0)
		if err != nil {
			punchTail(p.fd, size, p.size())
			r.punching.Done()
			return m
		}
		go func() {
			defer r.punching.Done()
			punchTail(dup, size, p.size())
			unix.Close(dup)
		}()
	}
	return m
}

// mapPiece maps the first size bytes of p (whole huge pages on hugetlbfs)
// with the page table entries for its pages made, on several threads: the
// pages exist, so this is their entries alone, and the eviction's copy
// takes no page faults.
func mapPiece(p *piece, size int64) ([]byte, error) {
	b, err := unix.Mmap(p.fd, 0, int(mapLength(p.fd, size)), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, err
	}
	if p.thp {
		unix.Madvise(b, unix.MADV_HUGEPAGE)
	}
	chunk := reserveChunk
	if p.huge {
		chunk = len(b)
	}
	if err := populateWith(unix.MADV_POPULATE_READ, b, chunk, max(1, min(16, runtime.NumCPU()/2)), nil, nil); err != nil {
		unix.Munmap(b)
		return nil, err
	}
	return b, nil
}

// punchTail frees the pages of fd from off to its end, end bytes. Its
// size stays: it is sealed.
func punchTail(fd int, off, end int64) {
	unix.Fallocate(fd, unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, off, end-off)
}

// Reserved reports the reserve (Reserve), for info and metrics.
func (s *Spill) Reserved() segment.Reserve {
	r := s.res.Load()
	if r == nil {
		return segment.Reserve{}
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	st := segment.Reserve{Target: r.target()}
	for _, p := range r.pieces {
		if p != nil {
			st.Memfds++
			st.Bytes += p.size()
		}
	}
	st.Takes, st.TakenBytes = r.takes, r.takenBytes
	return st
}

// makePiece makes a piece of size bytes, of hugetlbfs when hugePage (its
// page size) is set, its pages made by threads of the lowest priority that
// ask more before each chunk. keeper, if not nil, holds it from the start
// (Keeper): a serving process killed while it makes a piece of GiB must
// not be the one to free it either.
func makePiece(size, hugePage int64, thp bool, more func() bool, keeper Keeper, id uint64) (*piece, error) {
	if !more() {
		return nil, errStopped
	}
	huge := hugePage > 0
	flags := unix.MFD_CLOEXEC | unix.MFD_ALLOW_SEALING
	if huge {
		flags |= unix.MFD_HUGETLB
	}
	fd, err := unix.MemfdCreate("gpushm-spill", flags)
	if err != nil {
		return nil, fmt.Errorf("memfd_create: %w", err)
	}
	p := &piece{fd: fd, n: size, huge: huge, thp: thp && !huge}
	fail := func(err error) (*piece, error) {
		p.free()
		return nil, err
	}
	if err := unix.Ftruncate(fd, size); err != nil {
		return fail(fmt.Errorf("ftruncate: %w", err))
	}
	if keeper != nil {
		p.keeper, p.id = keeper, id
		keeper.Hold(id, fd)
	}
	chunk := max(reserveChunk, hugePage) // whole huge pages
	workers := max(1, min(16, runtime.NumCPU()/2))
	if err := populateFD(fd, size, chunk, workers, p.thp, more); err != nil {
		return fail(err)
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW|unix.F_SEAL_SEAL); err != nil {
		return fail(fmt.Errorf("seal: %w", err))
	}
	restrict(fd)
	return p, nil
}

// populateFD makes the pages of the memfd fd, size bytes, chunk bytes at
// a time on up to workers threads of the lowest priority, each chunk
// through a mapping of its own that goes once its pages are made: the
// daemon never maps more of a piece than its workers' chunks (piece says
// why), and munmap, which holds the memory map lock for writing, is never
// long. more is asked before each chunk; its first no stops all with
// errStopped.
func populateFD(fd int, size, chunk int64, workers int, thp bool, more func() bool) error {
	n := (size + chunk - 1) / chunk
	err := inChunks(int(n), workers, lowPriority, more, func(i int) error {
		off := int64(i) * chunk
		l := min(chunk, size-off)
		ptr, err := unix.MmapPtr(fd, off, nil, uintptr(l), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
		if err != nil {
			return fmt.Errorf("mmap: %w", err)
		}
		b := unsafe.Slice((*byte)(ptr), int(l))
		if thp {
			unix.Madvise(b, unix.MADV_HUGEPAGE) // a hint: none is no error
		}
		err = unix.Madvise(b, unix.MADV_POPULATE_WRITE)
		unix.MunmapPtr(ptr, uintptr(l))
		return noMem(err)
	})
	if err != nil {
		return fmt.Errorf("populate %d bytes of host memory: %w", size, err)
	}
	return nil
}

// lowPriority gives the calling goroutine a thread of its own at the
// lowest priority (nice 19); the thread ends with the goroutine, which
// never unlocks it.
func lowPriority() {
	runtime.LockOSThread()
	unix.Setpriority(unix.PRIO_PROCESS, unix.Gettid(), 19)
}
