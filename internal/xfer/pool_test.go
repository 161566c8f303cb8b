package xfer

import (
	"testing"
	"time"
)

// fakePool is a Pool of max kits that pins nothing.
func fakePool(max int) *Pool {
	return &Pool{chunk: defaultChunk, max: max, back: make(chan struct{}),
		make: func() (*kit, error) { return &kit{}, nil }}
}

// getLater has a copier of l other than the first ask p for a kit.
func getLater(p *Pool, l *loan, over, stop chan struct{}) <-chan *kit {
	got := make(chan *kit, 1)
	go func() {
		k, _ := p.get(l, false, over, stop)
		got <- k
	}()
	return got
}

// TestPoolNeverStopsACopy: copies whose reads never return hold the
// kits they took, and the next copy runs all the same: its first copier
// gets a kit at once, of its own beyond the pool if none is left; its
// others take a kit as one comes back, or give up when the copy has no
// chunk left for them, or stops. No copy holds more than half the pool.
func TestPoolNeverStopsACopy(t *testing.T) {
	p := fakePool(4)
	never := make(chan struct{})
	// Two stuck copies: each takes its share, half the pool, and no more.
	var stuck [2]*loan
	var kits [2][]*kit
	for i := range stuck {
		stuck[i] = &loan{}
		for j := range 2 {
			k, err := p.get(stuck[i], j == 0, never, never)
			if err != nil || k == nil || k.own {
				t.Fatalf("stuck copy %d, copier %d: kit %+v, %v; want one of the pool", i, j, k, err)
			}
			kits[i] = append(kits[i], k)
		}
	}
	over := make(chan struct{})
	select {
	case k := <-getLater(p, stuck[0], over, never):
		t.Fatalf("a copy took %+v beyond its share of the pool", k)
	case <-time.After(50 * time.Millisecond):
	}
	close(over)

	// The next copy: its first copier gets a kit of its own, at once.
	next := &loan{}
	done := make(chan *kit, 1)
	go func() {
		k, err := p.get(next, true, never, never)
		if err != nil {
			t.Error(err)
		}
		done <- k
	}()
	var own *kit
	select {
	case own = <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("a copy's first copier waited for kits stuck copies hold")
	}
	if own == nil || !own.own {
		t.Fatalf("first copier of a copy with the pool taken: %+v, want a kit of its own", own)
	}
	// Its second copier waits, and takes the first kit that comes back.
	over = make(chan struct{})
	second := getLater(p, next, over, never)
	select {
	case k := <-second:
		t.Fatalf("the second copier got %+v with the pool taken", k)
	case <-time.After(50 * time.Millisecond):
	}
	p.put(stuck[1], kits[1][0])
	if k := <-second; k != kits[1][0] {
		t.Fatalf("the second copier got %+v, want the kit given back", k)
	}
	// A kit of its own is not kept.
	p.put(next, own)
	if len(p.free) != 0 || p.count != 4 {
		t.Fatalf("pool of %d kits (%d free) after a copy's own kit came back, want 4 (0 free)", p.count, len(p.free))
	}
	// A copier that waits gives up when its copy stops.
	stop := make(chan struct{})
	third := getLater(p, next, over, stop)
	close(stop)
	if k := <-third; k != nil {
		t.Fatalf("a copier of a stopped copy got %+v", k)
	}
}
