package gpushm_test

import (
	"bytes"
	"context"
	"fmt"
	"log"

	"github.com/gpushm/gpushm"
)

// A producer creates a named segment and writes it; a consumer, usually
// another process, opens the name and maps the same memory: no copy in
// between. (The tests run the examples against a daemon on the host
// backend, at $GPUSHM_SOCKET.)
func Example() {
	ctx := context.Background()
	c, err := gpushm.Dial(ctx, "") // $GPUSHM_SOCKET, else SocketCandidates
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()

	// The producer: 4 KiB named "example-greeting", mapped and written
	// (on cuda, m.DevicePtr is the GPU pointer to hand to a kernel).
	seg, err := c.Create(ctx, "example-greeting", 4096, nil)
	if err != nil {
		log.Fatal(err)
	}
	defer c.Unlink(ctx, "example-greeting")
	defer seg.Close()
	m, err := seg.Map()
	if err != nil {
		log.Fatal(err)
	}
	if _, err := m.WriteAt([]byte("hello, gpushm"), 0); err != nil {
		log.Fatal(err)
	}

	// The consumer: the name, opened for reading and mapped.
	r, err := c.Open(ctx, "example-greeting", &gpushm.OpenOptions{ReadOnly: true})
	if err != nil {
		log.Fatal(err)
	}
	defer r.Close()
	rm, err := r.Map()
	if err != nil {
		log.Fatal(err)
	}
	buf := make([]byte, 13)
	if _, err := rm.ReadAt(buf, 0); err != nil {
		log.Fatal(err)
	}
	fmt.Printf("%s (a segment of %d bytes)\n", buf, r.Size())
	// Output: hello, gpushm (a segment of 4096 bytes)
}

// A channel hands a stream of messages from a producer to a consumer
// through slots in shared memory: no copy, and no round trip to the daemon
// per message.
func ExampleClient_Channel() {
	ctx := context.Background()
	c, err := gpushm.Dial(ctx, "")
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()

	// The producer makes the channel "example-stream": 4 slots of 1 KiB.
	tx, err := c.Channel(ctx, "example-stream", gpushm.Producer, &gpushm.ChannelOptions{SlotBytes: 1024})
	if err != nil {
		log.Fatal(err)
	}
	defer c.Unlink(ctx, "example-stream")
	defer tx.Close()
	// The consumer, usually another process, opens it by name.
	rx, err := c.Channel(ctx, "example-stream", gpushm.Consumer, nil)
	if err != nil {
		log.Fatal(err)
	}
	defer rx.Close()

	// Stream 0: on a cuda channel the CUstream that fills (or reads) the
	// slot, through DevicePtr; on the host backend, Bytes is the slot.
	for i := range 3 {
		msg, err := tx.Send(ctx, 0)
		if err != nil {
			log.Fatal(err)
		}
		copy(msg.Bytes(), fmt.Sprintf("message %d", i))
		if err := msg.Done(0); err != nil {
			log.Fatal(err)
		}
	}
	for range 3 {
		msg, err := rx.Recv(ctx, 0)
		if err != nil {
			log.Fatal(err)
		}
		fmt.Println(string(bytes.TrimRight(msg.Bytes(), "\x00")))
		if err := msg.Done(0); err != nil {
			log.Fatal(err)
		}
	}
	// Output:
	// message 0
	// message 1
	// message 2
}
