package channel

import (
	"errors"
	"strings"
	"testing"
	"time"
)

// The block's rules, one process playing every part: the producer's CPU
// and its "GPU" (which writes filled flags later than the CPU hands
// messages over, as a stream does), the consumer, and the daemon's repair.
// The tests across processes are in the client packages.

func newBlock(t *testing.T, slots int) *Block {
	t.Helper()
	k, err := Map(make([]byte, BlockBytes))
	if err != nil {
		t.Fatal(err)
	}
	k.Init(slots, 64, Stride(64))
	return k
}

// send hands messages over up to head (the producer's CPU) and lets the
// producer's GPU finish the first done of them, in order.
func send(k *Block, head, done uint64) {
	slots := uint64(k.Slots())
	for m := k.Head(); m < head; m++ {
		k.Sent(m)
	}
	for m := range done {
		k.MarkFilled(int(m%slots), m+1)
	}
}

// take takes the next message as a consumer whose stream waits for the
// flags (host false) or whose CPU does (true), and fails on anything but
// a message to read.
func take(t *testing.T, k *Block, host bool, seen uint64) uint64 {
	t.Helper()
	m, skip, err := k.WaitMessage(-1, nil, host, seen)
	if err != nil || skip {
		t.Fatalf("WaitMessage = %d, skip %v, %v; want a message", m, skip, err)
	}
	return m
}

func release(k *Block, m uint64) {
	k.MarkDrained(int(m%uint64(k.Slots())), m+1)
	k.Released(m)
}

// A dead producer's first unfinished message is the one its flags say,
// however far its CPU ran ahead of its GPU and the consumer's CPU ahead of
// both; every flag a stream may wait on is met, and tells itself apart.
func TestCutIsTheFirstUnfinishedMessage(t *testing.T) {
	for _, tc := range []struct {
		name              string
		slots             int
		head, done, taken uint64
	}{
		{"the last message unfinished", 4, 10, 9, 9},
		{"one slot cycle unfinished, none of it taken", 4, 11, 7, 7},
		{"unfinished messages taken and released", 4, 12, 8, 12},
		{"the CPUs far ahead of the GPU", 4, 40, 9, 37},
		{"nothing finished", 4, 3, 0, 0},
		{"one slot", 1, 7, 6, 7},
		{"many slots, few messages", 64, 5, 2, 4},
	} {
		t.Run(tc.name, func(t *testing.T) {
			k := newBlock(t, tc.slots)
			k.Attach(Rx, 2, 2)
			k.Attach(Tx, 1, 1)
			send(k, tc.head, tc.done)
			for range tc.taken {
				if m := take(t, k, false, 0); m+1 < tc.taken {
					release(k, m) // the last one taken stays out
				}
			}
			before := make([]uint64, tc.slots)
			for i := range before {
				before[i] = k.Filled(i)
			}
			k.Detach(Tx, true)
			b := k.Break()
			if b.First != tc.done || b.End != tc.head || b.Count != 1 {
				t.Fatalf("Break() = %+v, want first %d, end %d, count 1", b, tc.done, tc.head)
			}
			slots := uint64(tc.slots)
			for i := range tc.slots {
				f := k.Filled(i)
				if i >= int(tc.head) {
					if f != 0 {
						t.Errorf("unused slot %d: flag %#x, want 0", i, f)
					}
					continue
				}
				last := tc.head - 1 - (tc.head-1-uint64(i))%slots
				if last < tc.done {
					if f != before[i] {
						t.Errorf("slot %d, whole: flag %#x, want %#x unchanged", i, f, before[i])
					}
					continue
				}
				if f != Cut|(last+1) {
					t.Errorf("slot %d: flag %#x, want Cut|%d", i, f, last+1)
				}
				for m := uint64(i); m <= last; m += slots {
					if !Reached(f, m+1) {
						t.Errorf("slot %d: a stream's wait for message %d is not met by %#x", i, m, f)
					}
				}
			}
		})
	}
}

func TestWholeMessagesAreNoBreak(t *testing.T) {
	k := newBlock(t, 4)
	k.Attach(Rx, 2, 2)
	k.Attach(Tx, 1, 1)
	send(k, 6, 6)
	k.Detach(Tx, true)
	if b := k.Break(); b.Count != 0 {
		t.Fatalf("Break() = %+v after a death with every message whole", b)
	}
	for range 6 {
		release(k, take(t, k, true, 0))
	}
	if _, _, err := k.WaitMessage(-1, nil, true, 0); !errors.Is(err, ErrEOF) {
		t.Fatalf("after every message: %v, want ErrEOF", err)
	}
}

func brokenAt(t *testing.T, err error, seq uint64) *BrokenError {
	t.Helper()
	var b *BrokenError
	if !errors.As(err, &b) || !errors.Is(err, ErrBroken) || b.Seq != seq {
		t.Fatalf("got %v, want a BrokenError for message %d", err, seq)
	}
	return b
}

// A consumer whose stream waits (cuda) takes messages before the
// producer's GPU wrote them; the producer dies. It is told once, at its
// next release or call, naming the first unfinished message; then the
// messages cut off are skipped, and the stream ends.
func TestConsumerToldOnceThenSkips(t *testing.T) {
	k := newBlock(t, 4)
	k.Attach(Rx, 2, 2)
	k.Attach(Tx, 1, 1)
	send(k, 6, 3)
	for m := range uint64(4) {
		if got := take(t, k, false, 0); got != m {
			t.Fatalf("took %d, want %d", got, m)
		}
		release(k, m)
		if e := k.Untold(m, 0); e != nil {
			t.Fatalf("release of %d before the death: %v", m, e)
		}
	}
	m := take(t, k, false, 0) // message 4, still out
	k.Detach(Tx, true)
	release(k, m)
	e := k.Untold(m, 0)
	if e == nil {
		t.Fatal("the release of a message cut off says nothing")
	}
	seen := brokenAt(t, e, 3).Count
	if e := k.Untold(m, seen); e != nil {
		t.Fatalf("told twice: %v", e)
	}
	got, skip, err := k.WaitMessage(-1, nil, false, seen)
	if err != nil || !skip || got != 5 {
		t.Fatalf("WaitMessage = %d, skip %v, %v; want 5 skipped", got, skip, err)
	}
	release(k, got)
	if _, _, err := k.WaitMessage(-1, nil, false, seen); !errors.Is(err, ErrEOF) {
		t.Fatalf("after the messages cut off: %v, want ErrEOF", err)
	}
}

// A consumer that had taken and released everything before the death is
// told at its next call, instead of the end of the stream.
func TestConsumerPastTheBreakIsToldBeforeEOF(t *testing.T) {
	k := newBlock(t, 2)
	k.Attach(Rx, 2, 2)
	k.Attach(Tx, 1, 1)
	send(k, 2, 0)
	release(k, take(t, k, false, 0))
	release(k, take(t, k, false, 0))
	k.Detach(Tx, true)
	_, _, err := k.WaitMessage(-1, nil, false, 0)
	seen := brokenAt(t, err, 0).Count
	if _, _, err := k.WaitMessage(-1, nil, false, seen); !errors.Is(err, ErrEOF) {
		t.Fatalf("then: %v, want ErrEOF", err)
	}
	// A consumer attaching now has nothing cut off to meet.
	if s := k.Seen(); s != seen {
		t.Fatalf("Seen() = %d for a consumer past the break, want %d", s, seen)
	}
}

// On host memory the consumer's CPU waits for the flag a stream would:
// a message handed over before its writes are done is not read, and its
// producer's death makes it the broken one.
func TestHostConsumerWaitsForTheFlag(t *testing.T) {
	k := newBlock(t, 4)
	k.Attach(Rx, 2, 2)
	k.Attach(Tx, 1, 1)
	send(k, 3, 1)
	release(k, take(t, k, true, 0))
	if m, _, err := k.WaitMessage(-1, nil, true, 0); !errors.Is(err, ErrTimeout) {
		t.Fatalf("message 1 before its flag: %d, %v; want ErrTimeout", m, err)
	}
	k.MarkFilled(1, 2)
	release(k, take(t, k, true, 0))
	k.Detach(Tx, true)
	_, _, err := k.WaitMessage(-1, nil, true, 0)
	brokenAt(t, err, 2)
}

// A next producer goes on after the messages cut off: its own are not
// met by the cut marks, and the consumer gets them after skipping.
func TestNextProducerGoesOnAfterTheCut(t *testing.T) {
	k := newBlock(t, 2)
	k.Attach(Rx, 2, 2)
	k.Attach(Tx, 1, 1)
	send(k, 2, 1)
	release(k, take(t, k, true, 0))
	k.Detach(Tx, true)
	k.Attach(Tx, 3, 3)
	if h := k.Head(); h != 2 {
		t.Fatalf("head %d after a new producer attached, want 2: the numbers go on", h)
	}
	for i := range 2 {
		if f := k.Filled(i); f&Cut != 0 {
			t.Errorf("slot %d keeps its cut mark %#x under a new producer", i, f)
		}
	}
	m, err := k.WaitSlot(true, -1, nil)
	if err != nil || m != 2 {
		t.Fatalf("WaitSlot = %d, %v; want message 2", m, err)
	}
	k.Sent(m) // handed over; its writes are not done
	if Reached(k.Filled(0), 3) {
		t.Fatalf("a stream's wait for the new message 2 is met by %#x before its writes", k.Filled(0))
	}
	seen := k.Seen() // a consumer attaching now
	_, _, err = k.WaitMessage(-1, nil, true, seen)
	seen = brokenAt(t, err, 1).Count
	if m, skip, err := k.WaitMessage(-1, nil, true, seen); err != nil || !skip || m != 1 {
		t.Fatalf("WaitMessage = %d, skip %v, %v; want 1 skipped", m, skip, err)
	}
	release(k, 1)
	if m, _, err := k.WaitMessage(-1, nil, true, seen); !errors.Is(err, ErrTimeout) {
		t.Fatalf("the new message before its flag: %d, %v; want ErrTimeout", m, err)
	}
	k.MarkFilled(0, 3)
	if got := take(t, k, true, seen); got != 2 {
		t.Fatalf("took %d, want 2", got)
	}
}

// A producer that dies before the consumer went past the last break
// extends it: the consumer, told of the first, is told again and never
// takes a message of either producer that was cut off.
func TestSecondBreakBeforeTheFirstWasPassed(t *testing.T) {
	k := newBlock(t, 4)
	k.Attach(Rx, 2, 2)
	k.Attach(Tx, 1, 1)
	send(k, 3, 1) // 1 and 2 cut off
	k.Detach(Tx, true)
	k.Attach(Tx, 3, 3)
	send(k, 5, 1) // the next producer's 3 and 4, unfinished
	k.Detach(Tx, true)
	b := k.Break()
	if b.First != 1 || b.End != 5 || b.Count != 2 {
		t.Fatalf("Break() = %+v, want first 1, end 5, count 2", b)
	}
	release(k, take(t, k, true, 0))
	_, _, err := k.WaitMessage(-1, nil, true, 0)
	seen := brokenAt(t, err, 1).Count
	for want := uint64(1); want < 5; want++ {
		m, skip, err := k.WaitMessage(-1, nil, true, seen)
		if err != nil || !skip || m != want {
			t.Fatalf("WaitMessage = %d, skip %v, %v; want %d skipped", m, skip, err, want)
		}
		release(k, m)
	}
	if _, _, err := k.WaitMessage(-1, nil, true, seen); !errors.Is(err, ErrEOF) {
		t.Fatalf("then: %v, want ErrEOF", err)
	}
}

func TestReachedIsCyclic(t *testing.T) {
	for _, tc := range []struct {
		v, want uint64
		ok      bool
	}{
		{5, 5, true}, {6, 5, true}, {4, 5, false}, {0, 1, false},
		{Cut | 5, 5, true}, {Cut | 5, 1, true}, {Cut | 5, 1 << 40, true},
		{1 << 63, 0, false}, // half the ring away: behind
	} {
		if got := Reached(tc.v, tc.want); got != tc.ok {
			t.Errorf("Reached(%#x, %#x) = %v, want %v", tc.v, tc.want, got, tc.ok)
		}
	}
}

// A dead producer's GPU work may run a little past the moment its death is
// seen: a late write of an older message's flag lowers the cut mark under
// a consumer's stream wait, and Recut puts it back until a producer holds
// the channel again.
func TestRecutUndoesLateWrites(t *testing.T) {
	k := newBlock(t, 4)
	k.Attach(Rx, 2, 2)
	k.Attach(Tx, 1, 1)
	send(k, 10, 5) // messages 5 to 9 handed over, their writes queued
	k.Detach(Tx, true)
	b := k.Break()
	if b.First != 5 || b.End != 10 {
		t.Fatalf("Break = %+v, want messages 5 to 9 cut off", b)
	}
	// Message 9 is slot 1's: its consumer stream waits for flag 10.
	if !Reached(k.Filled(1), 10) {
		t.Fatalf("after the cut, slot 1's flag %#x does not meet a wait for 10", k.Filled(1))
	}
	k.MarkFilled(1, 6) // the dead producer's late write of message 5's flag
	if Reached(k.Filled(1), 10) {
		t.Fatalf("the late write left flag %#x, which the test expected below the mark", k.Filled(1))
	}
	if !k.Recut() {
		t.Fatal("Recut = false with the break standing and no producer")
	}
	if !Reached(k.Filled(1), 10) {
		t.Fatalf("after Recut, slot 1's flag %#x still does not meet a wait for 10", k.Filled(1))
	}
	k.Attach(Tx, 3, 3)
	if k.Recut() {
		t.Fatal("Recut = true with a producer holding the channel again")
	}
}

// waitAsleep waits until the end that sleeps on the event word at off says
// so in its sleeping word.
func waitAsleep(t *testing.T, k *Block, off int) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); k.u32(off+4).Load() == 0; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the waiter never said it sleeps (word at %d)", off+4)
		}
	}
}

// A waiter says that it sleeps before it sleeps, is woken by the hand-off,
// and says it is awake once its wait ends; a hand-off to an end that does
// not sleep leaves the word alone.
func TestWaitSaysItSleeps(t *testing.T) {
	k := newBlock(t, 4)
	k.Attach(Rx, 2, 2)
	k.Attach(Tx, 1, 1)
	got := make(chan error, 1)
	go func() {
		m, _, err := k.WaitMessage(0, nil, false, 0)
		if err == nil && m != 0 {
			err = errors.New("took the wrong message")
		}
		got <- err
	}()
	waitAsleep(t, k, offRxEvent)
	k.Sent(0)
	select {
	case err := <-got:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the consumer slept through the hand-off")
	}
	if w := k.u32(offRxSleep).Load(); w != 0 {
		t.Errorf("after the wait, rx's sleeping word = %d, want 0", w)
	}
	k.Sent(1)
	if w := k.u32(offRxSleep).Load(); w != 0 {
		t.Errorf("after a hand-off to an end awake, rx's sleeping word = %d, want 0", w)
	}
}

// The sleeping words are the ends' to write, a hostile end's too: one that
// clears its peer's word (so that no wake comes) or fills it with garbage
// delays its peer, never hangs it.
func TestHostileSleepingWordsDelayNeverHang(t *testing.T) {
	for _, word := range []uint32{0, 0xFFFFFFFF} {
		k := newBlock(t, 1)
		k.Attach(Rx, 2, 2)
		k.Attach(Tx, 1, 1)
		k.Sent(0) // the one slot is full: the producer waits for its release
		got := make(chan error, 1)
		go func() {
			_, err := k.WaitSlot(true, 0, nil)
			got <- err
		}()
		waitAsleep(t, k, offTxEvent)
		k.u32(offTxSleep).Store(word)
		k.MarkDrained(0, 1)
		k.u64(offTail).Store(1) // released, and no wake unless the word asks
		if word != 0 {
			k.notify(offTxEvent)
		}
		select {
		case err := <-got:
			if err != nil {
				t.Fatalf("word %#x: WaitSlot = %v", word, err)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("word %#x: the producer never saw the free slot", word)
		}
	}
}

// Ends of one version only share a channel; the daemon keeps blocks of
// version 1 and upgrades one that no end holds.
func TestVersions(t *testing.T) {
	k := newBlock(t, 4)
	if err := k.CheckVersion(); err != nil {
		t.Fatalf("a new block: CheckVersion = %v", err)
	}
	k.u32(offVersion).Store(1)
	k.u32(offRxSleep).Store(1) // not a word of version 1: Upgrade must not trust it
	if _, _, _, err := k.Check(); err != nil {
		t.Fatalf("version 1: Check = %v, want the daemon to keep it", err)
	}
	if err := k.CheckVersion(); err == nil || !strings.Contains(err.Error(), "version 1") {
		t.Fatalf("version 1: CheckVersion = %v, want an error naming the version", err)
	}
	k.Attach(Rx, 2, 2)
	k.Upgrade()
	if v := k.Version(); v != 1 {
		t.Fatalf("Upgrade with a consumer of version 1 attached: version %d, want 1", v)
	}
	k.Detach(Rx, false)
	k.Upgrade()
	if v, w := k.Version(), k.u32(offRxSleep).Load(); v != Version || w != 0 {
		t.Fatalf("Upgrade with no end attached: version %d, rx sleeping %d; want %d, 0", v, w, Version)
	}
	k.u32(offVersion).Store(Version + 1)
	if _, _, _, err := k.Check(); err == nil {
		t.Fatal("a block of a newer version: Check = nil, want an error")
	}
}
