package bench

import (
	"context"
	"encoding/binary"
	"fmt"
	"os"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/bytesize"
	"github.com/gpushm/gpushm/internal/cuda"
)

// bench channel: the channel's own rate between two Go processes, with no
// Python and no kernels. Each message's first four bytes are its number,
// written on the producer's stream by a copy from pinned memory; the
// consumer copies them, on its stream, into a pinned array at the
// message's place, and checks the array once every message is in. On the
// host backend the CPU writes and checks them.

func benchChannelCmd() *cobra.Command {
	var (
		backend, sizes, slots string
		count                 int
	)
	cmd := &cobra.Command{
		Use:   "channel",
		Short: "Messages per second through a channel between two Go processes, every message checked",
		Long: `For each message size and slot count, on a private daemon: this process
makes a channel and sends --count messages back to back; a second process
receives them. Each message carries its number in its first four bytes,
written on the producer's stream (cuda: a copy from pinned memory; host:
the CPU); the consumer copies it out on its own stream into a pinned
array at the message's place and checks every number once all are in
(host: at once). The rate is the consumer's: from its first message to its
last, its GPU work included. Go on both ends: what a consumer in a
compiled language gets, beside bench_channel.py's torch ends.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			list, err := parseSizes(sizes, "--count", count)
			if err != nil {
				return err
			}
			var ns []int
			for _, s := range strings.Split(slots, ",") {
				n, err := strconv.Atoi(strings.TrimSpace(s))
				if err != nil || n < 1 {
					return fmt.Errorf("--slots %q: want slot counts of at least 1, separated by commas", slots)
				}
				ns = append(ns, n)
			}
			return withPrivateDaemon(cmd.Context(), backend, func(d *privateDaemon, c *gpushm.Client) error {
				return benchChannel(cmd.Context(), d, c, list, ns, count)
			})
		},
	}
	cmd.Flags().StringVar(&backend, "backend", "auto", "backend: auto, cuda or host")
	cmd.Flags().StringVar(&sizes, "sizes", "4KiB,1MiB", "comma-separated message sizes")
	cmd.Flags().StringVar(&slots, "slots", "4,16", "comma-separated slot counts")
	cmd.Flags().IntVar(&count, "count", 20000, "messages per run")
	return cmd
}

// chanResult is the consumer's report.
type chanResult struct {
	NS  int64 // first message to the last done
	Bad int   // messages whose number was wrong
}

func benchChannel(ctx context.Context, d *privateDaemon, c *gpushm.Client, sizes []int64, slots []int, count int) error {
	type row struct {
		size  int64
		slots int
		rate  float64
		bad   int
	}
	var rows []row
	for _, size := range sizes {
		for _, n := range slots {
			name := fmt.Sprintf("bench-chan-%d-%d", size, n)
			r, err := sendMessages(ctx, d, c, name, size, n, count)
			if err != nil {
				return fmt.Errorf("%s messages, %d slots: %w", bytesize.Format(size), n, err)
			}
			rows = append(rows, row{size, n, float64(count-1) / (float64(r.NS) / 1e9), r.Bad})
		}
	}
	fmt.Printf("gpushm bench channel: backend %s, %d messages back to back each, Go on both ends, %s\n\n",
		c.Backend(), count, time.Now().UTC().Format("2006-01-02"))
	w := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(w, "size\tslots\tmessages/s\tus/message\tchecked\t")
	var bad int
	for _, r := range rows {
		fmt.Fprintf(w, "%s\t%d\t%.0f\t%.2f\t%s\t\n", bytesize.Format(r.size), r.slots, r.rate, 1e6/r.rate,
			map[bool]string{true: "every message", false: fmt.Sprintf("%d wrong", r.bad)}[r.bad == 0])
		bad += r.bad
	}
	if err := w.Flush(); err != nil {
		return err
	}
	if bad > 0 {
		return fmt.Errorf("%d messages held another number than was sent", bad)
	}
	return nil
}

// sendMessages runs one consumer process and sends it count messages.
func sendMessages(ctx context.Context, d *privateDaemon, c *gpushm.Client, name string, size int64, slots, count int) (chanResult, error) {
	tx, err := c.Channel(ctx, name, gpushm.Producer, &gpushm.ChannelOptions{Slots: slots, SlotBytes: size})
	if err != nil {
		return chanResult{}, err
	}
	defer c.Unlink(context.WithoutCancel(ctx), name)
	defer tx.Close()
	end, err := newChanEnd(c.Backend(), tx, count)
	if err != nil {
		return chanResult{}, err
	}
	defer end.close()
	type out struct {
		r   chanResult
		err error
	}
	done := make(chan out, 1)
	// A consumer that fails must not leave the producer waiting for a
	// slot: its end cancels the sends.
	sendCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		var r chanResult
		err := runChildJSON(ctx, &r, "channel", "--socket", d.socket, "--name", name, "--count", strconv.Itoa(count))
		if err != nil {
			cancel()
		}
		done <- out{r, err}
	}()
	for k := range count {
		m, err := tx.Send(sendCtx, end.handle)
		if err != nil && sendCtx.Err() != nil && ctx.Err() == nil {
			return chanResult{}, (<-done).err
		}
		if err != nil {
			return chanResult{}, fmt.Errorf("send %d: %w", k, err)
		}
		if err := end.put(m, k); err != nil {
			return chanResult{}, err
		}
		if err := m.Done(end.handle); err != nil {
			return chanResult{}, fmt.Errorf("send %d: %w", k, err)
		}
	}
	o := <-done
	return o.r, o.err
}

// chanEnd is what one end needs to write or read message numbers: on
// cuda a stream and a pinned array of count numbers.
type chanEnd struct {
	dev    *cuda.Device
	stream *cuda.Stream
	handle uintptr
	nums   []byte
}

func newChanEnd(backend string, ch *gpushm.Channel, count int) (*chanEnd, error) {
	e := &chanEnd{}
	if backend != "cuda" {
		return e, nil
	}
	dev, err := cuda.GetDevice(ch.Info().Device)
	if err != nil {
		return nil, err
	}
	if e.stream, err = dev.NewStream(); err != nil {
		return nil, err
	}
	if e.nums, err = dev.AllocHost(int64(4 * count)); err != nil {
		e.stream.Close()
		return nil, err
	}
	e.dev, e.handle = dev, e.stream.Handle()
	for k := range count {
		binary.LittleEndian.PutUint32(e.nums[4*k:], uint32(k))
	}
	return e, nil
}

// put writes k into message m's first four bytes.
func (e *chanEnd) put(m *gpushm.Message, k int) error {
	if e.stream == nil {
		binary.LittleEndian.PutUint32(m.Bytes(), uint32(k))
		return nil
	}
	return e.stream.CopyHtoDAsync(m.DevicePtr(), e.nums[4*k:4*k+4])
}

// get copies message m's number out to its place (cuda), or checks it
// (host): it reports whether it was k, when it can tell now.
func (e *chanEnd) get(m *gpushm.Message, k int) (bool, error) {
	if e.stream == nil {
		return binary.LittleEndian.Uint32(m.Bytes()) == uint32(k), nil
	}
	return true, e.stream.CopyDtoHAsync(e.nums[4*k:4*k+4], m.DevicePtr())
}

// wrong counts the numbers out of place once every copy is done (cuda).
func (e *chanEnd) wrong() (int, error) {
	if e.stream == nil {
		return 0, nil
	}
	if err := e.stream.Synchronize(); err != nil {
		return 0, err
	}
	bad := 0
	for k := range len(e.nums) / 4 {
		if binary.LittleEndian.Uint32(e.nums[4*k:]) != uint32(k) {
			bad++
		}
	}
	return bad, nil
}

func (e *chanEnd) close() {
	if e.stream == nil {
		return
	}
	e.stream.Synchronize()
	e.stream.Close()
	e.dev.FreeHost(e.nums)
}

func channelChildCmd() *cobra.Command {
	var (
		name  string
		count int
	)
	cmd := &cobra.Command{
		Use: "channel",
		RunE: withClient(func(ctx context.Context, c *gpushm.Client) error {
			rx, err := c.Channel(ctx, name, gpushm.Consumer, nil)
			if err != nil {
				return err
			}
			defer rx.Close()
			end, err := newChanEnd(c.Backend(), rx, count)
			if err != nil {
				return err
			}
			if end.stream != nil {
				clear(end.nums) // what comes must be what was sent
			}
			defer end.close()
			var r chanResult
			var start time.Time
			for k := range count {
				m, err := rx.Recv(ctx, end.handle)
				if err != nil {
					return fmt.Errorf("receive %d: %w", k, err)
				}
				if k == 0 {
					start = time.Now()
				}
				ok, err := end.get(m, k)
				if err != nil {
					return err
				}
				if !ok {
					r.Bad++
				}
				if err := m.Done(end.handle); err != nil {
					return fmt.Errorf("receive %d: %w", k, err)
				}
			}
			bad, err := end.wrong()
			if err != nil {
				return err
			}
			r.NS, r.Bad = time.Since(start).Nanoseconds(), r.Bad+bad
			return emit(r)
		}),
	}
	cmd.Flags().StringVar(&name, "name", "", "channel")
	cmd.Flags().IntVar(&count, "count", 0, "messages")
	return cmd
}
