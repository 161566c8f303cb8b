package gpushm_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/cuda"
	"github.com/gpushm/gpushm/internal/testdaemon"
	"github.com/gpushm/gpushm/internal/testutil"
)

// message is what message seq of a channel test holds: the number, then
// seq's pattern.
func message(seq uint64, n int64) []byte {
	b := pattern(seq+1000, n)
	binary.LittleEndian.PutUint64(b, seq)
	return b
}

// gpuStage copies a message between host and a slot through pinned memory
// on a stream, so that the channel's stream ordering is what keeps it
// right.
type gpuStage struct {
	dev    *cuda.Device
	stream *cuda.Stream
	pinned []byte
}

func newGPUStage(n int64) (*gpuStage, error) {
	d, err := cuda.GetDevice(0)
	if err != nil {
		return nil, err
	}
	s, err := d.NewStream()
	if err != nil {
		return nil, err
	}
	p, err := d.AllocHost(n)
	if err != nil {
		return nil, err
	}
	return &gpuStage{d, s, p}, nil
}

// streamHandle is the stream the channel orders on: the test's own.
func (g *gpuStage) handle() uintptr { return g.stream.Handle() }

// channelChild is a channel end in a process of its own: "chan-producer"
// sends COUNT messages and closes; "chan-consumer" receives until EOF and
// checks each; "chan-hold" receives one message, says so, and waits to be
// killed holding it; "chan-unwritten" (host memory) sends COUNT messages,
// then hands two more over whose writes never run, says so, and waits to
// be killed.
func channelChild(ctx context.Context, c *gpushm.Client, mode string) error {
	name := os.Getenv("NAME")
	count, _ := strconv.Atoi(os.Getenv("COUNT"))
	size, _ := strconv.ParseInt(os.Getenv("SIZE"), 10, 64)
	slots, _ := strconv.Atoi(os.Getenv("SLOTS"))
	var g *gpuStage
	if c.Backend() == "cuda" {
		var err error
		if g, err = newGPUStage(size); err != nil {
			return err
		}
	}
	var stream uintptr
	if g != nil {
		stream = g.handle()
	}
	switch mode {
	case "chan-unwritten":
		return sendUnwritten(ctx, c, name, count, slots, size)
	case "chan-producer":
		ch, err := c.Channel(ctx, name, gpushm.Producer, &gpushm.ChannelOptions{Slots: slots, SlotBytes: size})
		if err != nil {
			return err
		}
		first := uint64(0)
		for i := range uint64(count) {
			m, err := ch.Send(ctx, stream)
			if err != nil {
				return fmt.Errorf("send %d: %w", i, err)
			}
			if i == 0 {
				first = m.Seq() // a channel used before goes on counting
			}
			if m.Seq() != first+i {
				return fmt.Errorf("send %d got slot for message %d", i, m.Seq())
			}
			i := m.Seq()
			if g != nil {
				// The copy is queued on the stream, after the wait Send
				// queued; the pinned buffer may be rewritten only once
				// it ran, so wait for this copy (not for the consumer).
				copy(g.pinned, message(i, size))
				if err := g.stream.CopyHtoDAsync(m.DevicePtr(), g.pinned); err != nil {
					return err
				}
				if err := m.Done(stream); err != nil {
					return err
				}
				if err := g.stream.Synchronize(); err != nil {
					return err
				}
				continue
			}
			copy(m.Bytes(), message(i, size))
			if err := m.Done(0); err != nil {
				return err
			}
		}
		return ch.Close()
	case "chan-consumer", "chan-hold":
		ch, err := c.Channel(ctx, name, gpushm.Consumer, nil)
		if err != nil {
			return err
		}
		n := uint64(0)
		for {
			m, err := ch.Recv(ctx, stream)
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				return fmt.Errorf("recv %d: %w", n, err)
			}
			if mode == "chan-hold" {
				fmt.Println("holding", m.Seq())
				time.Sleep(time.Hour)
			}
			var got []byte
			if g != nil {
				if err := g.stream.CopyDtoHAsync(g.pinned, m.DevicePtr()); err != nil {
					return err
				}
				if err := m.Done(stream); err != nil {
					return err
				}
				if err := g.stream.Synchronize(); err != nil {
					return err
				}
				got = g.pinned
			} else {
				got = append([]byte(nil), m.Bytes()...)
				if err := m.Done(0); err != nil {
					return err
				}
			}
			if m.Seq() != n || !bytes.Equal(got, message(n, size)) {
				return fmt.Errorf("message %d (seq %d): wrong bytes", n, m.Seq())
			}
			n++
		}
		fmt.Println("received", n)
		return ch.Close()
	}
	return nil
}

// sendUnwritten is channelChild's "chan-unwritten": it sends count
// messages on host memory, then hands two more over whose writes never
// run, says so, and waits to be killed.
func sendUnwritten(ctx context.Context, c *gpushm.Client, name string, count, slots int, size int64) error {
	ch, err := c.Channel(ctx, name, gpushm.Producer, &gpushm.ChannelOptions{Slots: slots, SlotBytes: size})
	if err != nil {
		return err
	}
	for i := range uint64(count + 2) {
		m, err := ch.Send(ctx, 0)
		if err != nil {
			return fmt.Errorf("send %d: %w", i, err)
		}
		if i >= uint64(count) {
			m.HandOverUnwritten()
			continue
		}
		copy(m.Bytes(), message(m.Seq(), size))
		if err := m.Done(0); err != nil {
			return err
		}
	}
	fmt.Println("sent")
	time.Sleep(time.Hour)
	return nil
}

func TestChannelHandsOverInOrder(t *testing.T) {
	for _, b := range testdaemon.Backends() {
		t.Run(b, func(t *testing.T) {
			d := testdaemon.Start(t, b)
			const count, size = 3000, 10000
			env := []string{"NAME=ch", "COUNT=" + strconv.Itoa(count), "SIZE=" + strconv.Itoa(size), "SLOTS=4"}
			prod := child(t, d.Socket, "chan-producer", env...)
			if err := prod.Start(); err != nil {
				t.Fatal(err)
			}
			// The consumer may start before the channel exists: wait.
			c := dial(t, d.Socket)
			testutil.WaitFor(t, "channel ch", func() bool {
				_, err := c.Stat(context.Background(), "ch")
				return err == nil
			})
			cons := child(t, d.Socket, "chan-consumer", env...)
			var out bytes.Buffer
			cons.Stdout = &out
			if err := cons.Run(); err != nil {
				t.Fatalf("consumer: %v", err)
			}
			if err := prod.Wait(); err != nil {
				t.Fatalf("producer: %v", err)
			}
			if got := out.String(); got != fmt.Sprintf("received %d\n", count) {
				t.Fatalf("consumer said %q, want %d messages", got, count)
			}
		})
	}
}

func TestChannelBadInput(t *testing.T) {
	d := testdaemon.Start(t, "host")
	ctx := context.Background()
	c := dial(t, d.Socket)
	for _, tc := range []struct {
		name string
		o    gpushm.ChannelOptions
		want error
	}{
		{"no slots", gpushm.ChannelOptions{Slots: -1, SlotBytes: 10}, syscall.EINVAL},
		{"too many slots", gpushm.ChannelOptions{Slots: 65, SlotBytes: 10}, syscall.EINVAL},
	} {
		if _, err := c.Channel(ctx, "bad", gpushm.Producer, &tc.o); !errors.Is(err, tc.want) {
			t.Errorf("%s: %v, want %v", tc.name, err, tc.want)
		}
	}
	tx, err := c.Channel(ctx, "ch", gpushm.Producer, &gpushm.ChannelOptions{Slots: 2, SlotBytes: 100})
	if err != nil {
		t.Fatal(err)
	}
	// Another layout under the name.
	if _, err := c.Channel(ctx, "ch", gpushm.Consumer, &gpushm.ChannelOptions{Slots: 2, SlotBytes: 200}); !errors.Is(err, syscall.EEXIST) {
		t.Errorf("a layout mismatch: %v, want EEXIST", err)
	}
	// A second producer, from another process.
	other := dial(t, d.Socket)
	_ = other
	prod2 := child(t, d.Socket, "chan-producer", "NAME=ch", "COUNT=1", "SIZE=100", "SLOTS=2")
	var errOut bytes.Buffer
	prod2.Stderr = &errOut
	if err := prod2.Run(); err == nil || !bytes.Contains(errOut.Bytes(), []byte("has a producer already")) {
		t.Errorf("a second producer: %v, %q", err, errOut.String())
	}
	// No consumer, and asked not to wait.
	nowait, err := other.Channel(ctx, "ch2", gpushm.Producer, &gpushm.ChannelOptions{Slots: 1, SlotBytes: 8, NoWait: true})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := nowait.Send(ctx, 0); !errors.Is(err, gpushm.ErrNoConsumer) {
		t.Errorf("send with no consumer: %v, want ErrNoConsumer", err)
	}
	rx, err := c.Channel(ctx, "ch2", gpushm.Consumer, nil)
	if err != nil {
		t.Fatal(err)
	}
	m, err := nowait.Send(ctx, 0)
	if err != nil {
		t.Fatal(err)
	}
	m.Done(0)
	if _, err := nowait.Send(ctx, 0); !errors.Is(err, gpushm.ErrFull) {
		t.Errorf("send with every slot out: %v, want ErrFull", err)
	}
	// A role on a segment that is not a channel.
	if _, err := c.Create(ctx, "plain", 4096, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Channel(ctx, "plain", gpushm.Consumer, nil); !errors.Is(err, syscall.EINVAL) {
		t.Errorf("a role on a plain segment: %v, want EINVAL", err)
	}
	// Receiving from a removed channel.
	if err := c.Unlink(ctx, "ch2"); err != nil {
		t.Fatal(err)
	}
	got, err := rx.Recv(ctx, 0)
	if err != nil {
		t.Fatalf("the message sent before the rm: %v", err)
	}
	got.Done(0)
	tctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if _, err := rx.Recv(tctx, 0); !errors.Is(err, gpushm.ErrRemoved) {
		t.Errorf("recv on a removed channel: %v, want ErrRemoved", err)
	}
	tx.Close()
}

// A producer killed mid-stream ends the stream after what it sent; the
// consumer never hangs.
func TestChannelProducerDies(t *testing.T) {
	d := testdaemon.Start(t, "host")
	ctx := context.Background()
	c := dial(t, d.Socket)
	rx, err := c.Channel(ctx, "ch", gpushm.Consumer, &gpushm.ChannelOptions{Slots: 8, SlotBytes: 64})
	if err != nil {
		t.Fatal(err)
	}
	prod := child(t, d.Socket, "chan-producer", "NAME=ch", "COUNT=5", "SIZE=64", "SLOTS=8")
	// The producer sends 5, closes cleanly: EOF after 5.
	if err := prod.Run(); err != nil {
		t.Fatal(err)
	}
	tctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	for i := range 5 {
		m, err := rx.Recv(tctx, 0)
		if err != nil {
			t.Fatalf("message %d: %v", i, err)
		}
		m.Done(0)
	}
	if _, err := rx.Recv(tctx, 0); !errors.Is(err, io.EOF) {
		t.Fatalf("after the producer closed: %v, want io.EOF", err)
	}
	// A producer that is killed: a holder process takes the role and is
	// killed with nothing sent; the consumer's wait ends too.
	tx := child(t, d.Socket, "chan-producer", "NAME=ch", "COUNT=1000000000", "SIZE=64", "SLOTS=8")
	if err := tx.Start(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(200 * time.Millisecond)
	tx.Process.Kill()
	tx.Wait()
	got := 0
	for {
		m, err := rx.Recv(tctx, 0)
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("after the producer was killed: %v, want messages then io.EOF", err)
		}
		if !bytes.Equal(m.Bytes(), message(m.Seq(), 64)) {
			t.Fatalf("message %d: wrong bytes", m.Seq())
		}
		m.Done(0)
		got++
	}
	if got != 8 {
		t.Fatalf("%d messages from the killed producer, want the 8 that filled the slots", got)
	}
}

// A producer killed after handing over messages whose writes never ran
// (a GPU producer's CPU runs ahead of its stream): the consumer accepts
// every message before the first of them, is told of that one, once, and
// then gets the end of the stream.
func TestChannelProducerDiesWithWritesInFlight(t *testing.T) {
	d := testdaemon.Start(t, "host")
	ctx := context.Background()
	c := dial(t, d.Socket)
	rx, err := c.Channel(ctx, "ch", gpushm.Consumer, &gpushm.ChannelOptions{Slots: 4, SlotBytes: 64})
	if err != nil {
		t.Fatal(err)
	}
	tx := child(t, d.Socket, "chan-unwritten", "NAME=ch", "COUNT=5", "SIZE=64", "SLOTS=4")
	out, err := tx.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := tx.Start(); err != nil {
		t.Fatal(err)
	}
	defer tx.Process.Kill()
	tctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	for i := range uint64(5) {
		m, err := rx.Recv(tctx, 0)
		if err != nil {
			t.Fatalf("message %d: %v", i, err)
		}
		if m.Seq() != i || !bytes.Equal(m.Bytes(), message(i, 64)) {
			t.Fatalf("message %d (seq %d): wrong bytes", i, m.Seq())
		}
		if err := m.Done(0); err != nil {
			t.Fatalf("release %d: %v", i, err)
		}
	}
	if line, _ := bufio.NewReader(out).ReadString('\n'); line != "sent\n" {
		t.Fatalf("producer said %q", line)
	}
	// Handed over, not written: not read while the producer lives.
	short, cancelShort := context.WithTimeout(ctx, 50*time.Millisecond)
	_, err = rx.Recv(short, 0)
	cancelShort()
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("message 5 before its writes: %v, want a timeout", err)
	}
	tx.Process.Kill()
	tx.Wait()
	_, err = rx.Recv(tctx, 0)
	var cut *gpushm.BrokenError
	if !errors.As(err, &cut) || !errors.Is(err, gpushm.ErrBroken) || cut.Seq != 5 {
		t.Fatalf("after the producer died: %v, want a BrokenError for message 5", err)
	}
	if _, err := rx.Recv(tctx, 0); !errors.Is(err, io.EOF) {
		t.Fatalf("then: %v, want io.EOF (told once; the messages cut off skipped)", err)
	}
}

// A consumer killed holding a message frees its slots; a new consumer
// goes on from there.
func TestChannelConsumerDies(t *testing.T) {
	d := testdaemon.Start(t, "host")
	ctx := context.Background()
	c := dial(t, d.Socket)
	tx, err := c.Channel(ctx, "ch", gpushm.Producer, &gpushm.ChannelOptions{Slots: 2, SlotBytes: 64})
	if err != nil {
		t.Fatal(err)
	}
	hold := child(t, d.Socket, "chan-hold", "NAME=ch", "SIZE=64")
	out, _ := hold.StdoutPipe()
	if err := hold.Start(); err != nil {
		t.Fatal(err)
	}
	send := func(i uint64) {
		t.Helper()
		tctx, cancel := context.WithTimeout(ctx, 20*time.Second)
		defer cancel()
		m, err := tx.Send(tctx, 0)
		if err != nil {
			t.Fatalf("send %d: %v", i, err)
		}
		copy(m.Bytes(), message(i, 64))
		m.Done(0)
	}
	send(0)
	send(1)
	line, _ := bufio.NewReader(out).ReadString('\n')
	if line != "holding 0\n" {
		t.Fatalf("holder: %q", line)
	}
	hold.Process.Kill()
	hold.Wait()
	// Message 0 went with the consumer; message 1 waits for the next.
	rx, err := c.Channel(ctx, "ch", gpushm.Consumer, nil)
	if err != nil {
		t.Fatal(err)
	}
	send(2)
	for _, want := range []uint64{1, 2} {
		m, err := rx.Recv(ctx, 0)
		if err != nil {
			t.Fatal(err)
		}
		if m.Seq() != want || !bytes.Equal(m.Bytes(), message(want, 64)) {
			t.Fatalf("got message %d, want %d", m.Seq(), want)
		}
		m.Done(0)
	}
}

// One connection may hold both ends; closing one ends that one.
func TestChannelBothEndsOneClient(t *testing.T) {
	d := testdaemon.Start(t, "host")
	ctx := context.Background()
	c := dial(t, d.Socket)
	tx, err := c.Channel(ctx, "both", gpushm.Producer, &gpushm.ChannelOptions{Slots: 2, SlotBytes: 8,
		Meta: []byte(`{"kind":"channel","dtype":"uint8","shape":[8]}`)})
	if err != nil {
		t.Fatal(err)
	}
	// The layout includes the meta: another tensor shape is another channel.
	if _, err := c.Channel(ctx, "both", gpushm.Consumer, &gpushm.ChannelOptions{Slots: 2, SlotBytes: 8,
		Meta: []byte(`{"kind":"channel","dtype":"int8","shape":[8]}`)}); !errors.Is(err, syscall.EEXIST) {
		t.Fatalf("a consumer with another meta: %v, want EEXIST", err)
	}
	rx, err := c.Channel(ctx, "both", gpushm.Consumer, nil)
	if err != nil {
		t.Fatal(err)
	}
	m, err := tx.Send(ctx, 0)
	if err != nil {
		t.Fatal(err)
	}
	m.Done(0)
	if err := tx.Close(); err != nil {
		t.Fatal(err)
	}
	tctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	got, err := rx.Recv(tctx, 0)
	if err != nil {
		t.Fatal(err)
	}
	got.Done(0)
	if _, err := rx.Recv(tctx, 0); !errors.Is(err, io.EOF) {
		t.Fatalf("after the producer's close: %v, want io.EOF", err)
	}
}

// A channel replaced by a rename is removed as one unlinked is.
func TestChannelRenamedOver(t *testing.T) {
	d := testdaemon.Start(t, "host")
	ctx := context.Background()
	c := dial(t, d.Socket)
	rx, err := c.Channel(ctx, "r", gpushm.Consumer, &gpushm.ChannelOptions{Slots: 1, SlotBytes: 8})
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := c.CreateOnly(ctx, "p", 8, nil); err != nil {
		t.Fatal(err)
	}
	if err := c.Rename(ctx, "p", "r"); err != nil {
		t.Fatal(err)
	}
	tctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if _, err := rx.Recv(tctx, 0); !errors.Is(err, gpushm.ErrRemoved) {
		t.Fatalf("recv on a channel renamed over: %v, want ErrRemoved", err)
	}
}
