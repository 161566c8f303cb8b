package bench

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/cuda"
	"github.com/gpushm/gpushm/internal/wire"
)

// ChildCommand, the hidden __child command, holds the second-process halves of demo and bench. They run in a
// freshly exec'd process: a process that has initialised CUDA must never
// fork, and a second process is the point of the measurement.
func ChildCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:    "__child",
		Hidden: true,
		Args:   cobra.NoArgs,
	}
	cmd.AddCommand(verifyChildCmd(), openChildCmd(), idleChildCmd(), echoChildCmd(), channelChildCmd(), ucxServeChildCmd(), ucxGetChildCmd())
	return cmd
}

// emit writes one JSON result line for the parent.
func emit(v any) error {
	return json.NewEncoder(os.Stdout).Encode(v)
}

type verifyResult struct {
	OpenNS, MapNS, VerifyNS, WriteNS int64
	Device                           int
}

func verifyChildCmd() *cobra.Command {
	var name string
	var seed, writeSeed uint64
	cmd := &cobra.Command{
		Use: "verify",
		RunE: withClient(func(ctx context.Context, c *gpushm.Client) error {
			var r verifyResult
			t := time.Now()
			seg, err := c.Open(ctx, name, nil)
			if err != nil {
				return err
			}
			defer seg.Close()
			r.OpenNS = time.Since(t).Nanoseconds()
			t = time.Now()
			m, err := seg.Map()
			if err != nil {
				return err
			}
			r.MapNS, r.Device = time.Since(t).Nanoseconds(), m.Device()
			t = time.Now()
			chk := newPatternChecker(seed, m.Size())
			if _, err := m.WriteTo(chk); err != nil {
				return fmt.Errorf("verify %s: %w", name, err)
			}
			if err := chk.done(); err != nil {
				return fmt.Errorf("verify %s: %w", name, err)
			}
			r.VerifyNS = time.Since(t).Nanoseconds()
			if writeSeed == 0 {
				return emit(r)
			}
			t = time.Now()
			if _, err := m.ReadFrom(newPatternReader(writeSeed, m.Size())); err != nil {
				return fmt.Errorf("write %s: %w", name, err)
			}
			r.WriteNS = time.Since(t).Nanoseconds()
			return emit(r)
		}),
	}
	cmd.Flags().StringVar(&name, "name", "", "segment")
	cmd.Flags().Uint64Var(&seed, "seed", 0, "pattern to expect")
	cmd.Flags().Uint64Var(&writeSeed, "write-seed", 0, "pattern to write back (0: none)")
	return cmd
}

// samples is a child's list of per-iteration durations.
type samples struct {
	NS []int64
	// RoundTripNS is the Open part of NS: the daemon round trip alone.
	RoundTripNS []int64 `json:",omitempty"`
	// FloorNS are import + map samples of an inherited descriptor, taken
	// alternately with NS so that both see the same machine.
	FloorNS []int64 `json:",omitempty"`
	// DaemonNS and StepNS are the daemon's own timing of each open (its
	// trace): in all, and by step.
	DaemonNS []int64            `json:",omitempty"`
	StepNS   map[string][]int64 `json:",omitempty"`
	// EchoNS are round trips to each echo server (by mode), taken in
	// turn with the opens.
	EchoNS map[string][]int64 `json:",omitempty"`
}

func openChildCmd() *cobra.Command {
	var (
		name     string
		iters    int
		reopen   bool
		readOnly bool
		floor    floorSpec
		echoes   []string
	)
	cmd := &cobra.Command{
		Use: "open",
		RunE: withClient(func(ctx context.Context, c *gpushm.Client) error {
			var err error
			var tr gpushm.Trace
			o := &gpushm.OpenOptions{ReadOnly: readOnly, Trace: &tr}
			if reopen {
				// Hold one open so every timed open finds it mapped.
				held, err := c.Open(ctx, name, o)
				if err != nil {
					return err
				}
				defer held.Close()
				if _, err := held.Map(); err != nil {
					return err
				}
			}
			var s samples
			var fdev *cuda.Device
			if floor.handle == wire.HandleCUDA {
				if fdev, err = cuda.GetDevice(floor.device); err != nil {
					return err
				}
			}
			// Echo servers, mode=socket each, reached as the client reaches
			// the daemon.
			echo := map[string]*echoClient{}
			var modes []string
			for _, e := range echoes {
				mode, socket, _ := strings.Cut(e, "=")
				ec, err := dialEcho(socket, gpushm.ClientSpin())
				if err != nil {
					return fmt.Errorf("echo server %s: %w", mode, err)
				}
				defer ec.c.Close()
				echo[mode] = ec
				modes = append(modes, mode)
			}
			// The first round warms up the driver and the connection.
			for i := -1; i < iters; i++ {
				for _, mode := range modes {
					d, err := echo[mode].roundTrip()
					if err != nil {
						return fmt.Errorf("echo server %s: %w", mode, err)
					}
					if i >= 0 {
						if s.EchoNS == nil {
							s.EchoNS = map[string][]int64{}
						}
						s.EchoNS[mode] = append(s.EchoNS[mode], d.Nanoseconds())
					}
				}
				if floor.handle != "" {
					t := time.Now()
					undo, err := mapFloor(fdev, floorFD, floor.size)
					el := time.Since(t)
					if err != nil {
						return fmt.Errorf("floor: %w", err)
					}
					if err := undo(); err != nil {
						return fmt.Errorf("floor: %w", err)
					}
					if i >= 0 {
						s.FloorNS = append(s.FloorNS, el.Nanoseconds())
					}
				}
				t := time.Now()
				seg, err := c.Open(ctx, name, o)
				if err != nil {
					return err
				}
				rt := time.Since(t)
				if _, err := seg.Map(); err != nil {
					return err
				}
				d := time.Since(t)
				if err := seg.Close(); err != nil {
					return err
				}
				if i >= 0 {
					s.NS = append(s.NS, d.Nanoseconds())
					s.RoundTripNS = append(s.RoundTripNS, rt.Nanoseconds())
					if !reopen {
						if s.StepNS == nil {
							s.StepNS = map[string][]int64{}
						}
						s.DaemonNS = append(s.DaemonNS, tr.TotalNS)
						for _, st := range tr.Steps {
							s.StepNS[st.Step] = append(s.StepNS[st.Step], st.NS)
						}
					}
				}
			}
			return emit(s)
		}),
	}
	cmd.Flags().StringVar(&name, "name", "", "segment")
	cmd.Flags().IntVar(&iters, "iters", 100, "iterations")
	cmd.Flags().BoolVar(&reopen, "reopen", false, "time opens of a segment this process already has mapped")
	cmd.Flags().BoolVar(&readOnly, "readonly", false, "open read-only")
	cmd.Flags().StringVar(&floor.handle, "floor-handle", "", "also time mapping fd 3, of this handle type, alternately")
	cmd.Flags().IntVar(&floor.device, "floor-device", 0, "GPU ordinal of fd 3")
	cmd.Flags().Int64Var(&floor.size, "floor-size", 0, "bytes to map of fd 3")
	cmd.Flags().StringArrayVar(&echoes, "echo", nil, "also time round trips to this echo server, MODE=SOCKET, alternately")
	return cmd
}

// withClient makes a child's RunE: fn with a client of the daemon the
// child was given.
func withClient(fn func(ctx context.Context, c *gpushm.Client) error) func(*cobra.Command, []string) error {
	return func(cmd *cobra.Command, _ []string) error {
		c, err := gpushm.Dial(cmd.Context(), socketOf(cmd))
		if err != nil {
			return err
		}
		defer c.Close()
		return fn(cmd.Context(), c)
	}
}

// socketOf is the daemon socket a child was given: the root command's
// --socket, which a child inherits as a persistent flag, else the default.
func socketOf(cmd *cobra.Command) string {
	if f := cmd.Flag("socket"); f != nil && f.Value.String() != "" {
		return f.Value.String()
	}
	return gpushm.DefaultSocket()
}
