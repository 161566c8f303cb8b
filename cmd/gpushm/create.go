package main

import (
	"encoding/json"
	"fmt"
	"strconv"
	"time"

	"github.com/spf13/cobra"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/bytesize"
)

func createCmd() *cobra.Command {
	var (
		device  string
		mode    string
		meta    string
		existOK bool
		pin     bool
		ttl     time.Duration
	)
	cmd := &cobra.Command{
		Use:   "create NAME SIZE",
		Short: "Create a segment (SIZE like 4096, 64MiB, 1G)",
		Long: `Create a named segment of SIZE bytes. SIZE takes K, M, G, T (powers of 1024,
also written KiB, MiB, ...) or KB, MB, GB, TB (powers of 1000). The segment
lives until 'gpushm rm'; its memory is rounded up to the device's allocation
granularity.`,
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			size, err := bytesize.Parse(args[1])
			if err != nil {
				return err
			}
			o := &gpushm.CreateOptions{ExistOK: existOK, TTL: ttl, Pin: pin}
			if mode != "" {
				m, err := strconv.ParseUint(mode, 8, 32)
				if err != nil {
					return fmt.Errorf("--mode %q: want octal permission bits such as 0640", mode)
				}
				m32 := uint32(m)
				o.Mode = &m32
			}
			if meta != "" {
				if !json.Valid([]byte(meta)) {
					return fmt.Errorf("--meta: not valid JSON")
				}
				o.Meta = json.RawMessage(meta)
			}
			c, err := dial(cmd.Context())
			if err != nil {
				return err
			}
			defer c.Close()
			if o.Device, err = resolveDevice(cmd.Context(), c, device); err != nil {
				return err
			}
			inf, created, err := c.CreateOnly(cmd.Context(), args[0], size, o)
			if err != nil {
				return err
			}
			verb := "created"
			if !created {
				verb = "exists:"
			}
			fmt.Printf("%s %s: %s on device %d (allocated %s)\n", verb, inf.Name, bytesize.Format(inf.Size), inf.Device, bytesize.Format(inf.AllocSize))
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&device, "device", "", "GPU ordinal or UUID (default: the daemon's first device)")
	f.StringVar(&mode, "mode", "", "permission bits in octal (default 0600)")
	f.StringVar(&meta, "meta", "", "user metadata, a JSON value")
	f.BoolVar(&existOK, "exist-ok", false, "succeed if the segment exists with the same size and device")
	f.BoolVar(&pin, "pin", false, "keep the segment on its device: never evict it to host memory when the device's budget needs room ('gpushm unpin' lets it go)")
	f.DurationVar(&ttl, "ttl", 0, "remove the segment once nobody has had it open for this long (e.g. 10m)")
	return cmd
}
