package gpushm_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/testdaemon"
)

// BenchmarkChannel hands messages from a producer to a consumer through a
// channel of 4 slots, back to back: one op is one message, sent, received
// and released. Both ends are clients of their own in this process (the
// producer a goroutine), so the figure is the hand-off's cost through the
// control block, without a second process's scheduling; the Python
// benchmark (python/bench/bench_channel.py) measures across processes. On
// the host backend each message is written and read on the CPU; on cuda
// the slots are not touched, and the stream operations go on the legacy
// default stream, which both ends share here.
func BenchmarkChannel(b *testing.B) {
	for _, backend := range testdaemon.Backends() {
		for _, size := range []int64{4 << 10, 1 << 20, 64 << 20} {
			b.Run(fmt.Sprintf("%s/%s", backend, sizeLabel(size)), func(b *testing.B) {
				benchChannel(b, backend, size)
			})
		}
	}
}

func sizeLabel(n int64) string {
	switch {
	case n >= 1<<20:
		return fmt.Sprintf("%dMiB", n>>20)
	default:
		return fmt.Sprintf("%dKiB", n>>10)
	}
}

func benchChannel(b *testing.B, backend string, size int64) {
	d := testdaemon.Start(b, backend)
	ctx := context.Background()
	dial := func() *gpushm.Client {
		c, err := gpushm.Dial(ctx, d.Socket)
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { c.Close() })
		return c
	}
	tx, err := dial().Channel(ctx, "bench", gpushm.Producer, &gpushm.ChannelOptions{Slots: 4, SlotBytes: size})
	if err != nil {
		b.Fatal(err)
	}
	rx, err := dial().Channel(ctx, "bench", gpushm.Consumer, nil)
	if err != nil {
		b.Fatal(err)
	}
	// No SetBytes: a message's cost is its hand-off, not its size (the
	// slots are mapped once; only two bytes of each are touched).
	b.ResetTimer()
	sent := make(chan error, 1)
	go func() {
		sent <- func() error {
			for i := range b.N {
				m, err := tx.Send(ctx, 0)
				if err != nil {
					return err
				}
				if p := m.Bytes(); p != nil {
					p[0], p[len(p)-1] = byte(i), byte(i)
				}
				if err := m.Done(0); err != nil {
					return err
				}
			}
			return tx.Close()
		}()
	}()
	for i := range b.N {
		m, err := rx.Recv(ctx, 0)
		if err != nil {
			b.Fatalf("message %d: %v", i, err)
		}
		if p := m.Bytes(); p != nil && (p[0] != byte(i) || p[len(p)-1] != byte(i)) {
			b.Fatalf("message %d holds %d, %d", i, p[0], p[len(p)-1])
		}
		if m.Seq() != uint64(i) {
			b.Fatalf("message %d has number %d", i, m.Seq())
		}
		if err := m.Done(0); err != nil {
			b.Fatal(err)
		}
	}
	if err := <-sent; err != nil {
		b.Fatal(err)
	}
	b.StopTimer()
	if _, err := rx.Recv(ctx, 0); err == nil {
		b.Fatal("a message after the producer closed")
	}
	rx.Close()
}
