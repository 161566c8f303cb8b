package cli

import (
	"encoding/json"
	"fmt"
	"strconv"
	"time"

	"github.com/spf13/cobra"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/bytesize"
	"github.com/gpushm/gpushm/internal/exitcode"
	"github.com/gpushm/gpushm/internal/report"
)

func createCmd() *cobra.Command {
	var (
		device  string
		mode    string
		meta    string
		existOK bool
		pin     bool
		persist bool
		offer   bool
		ttl     time.Duration
	)
	cmd := &cobra.Command{
		Use:   "create NAME SIZE",
		Short: "Create a segment (SIZE like 4096, 64MiB, 1G)",
		Long: `Create a named segment of SIZE bytes. SIZE takes K, M, G, T (powers of 1024,
also written KiB, MiB, ...) or KB, MB, GB, TB (powers of 1000). The segment
lives until 'gpushm rm'; its memory is rounded up to the device's allocation
granularity.`,
		Example: `  gpushm create kv 64MiB
  gpushm create scratch 1G --mode 0660 --ttl 10m
  gpushm create kv 64MiB --exist-ok -o json`,
		Args:              cobra.ExactArgs(2),
		ValidArgsFunction: cobra.NoFileCompletions,
		RunE: func(cmd *cobra.Command, args []string) error {
			return exitcode.Failed("create", args[0], create(cmd, args[0], args[1], device, mode, meta, existOK, pin, persist, offer, ttl))
		},
	}
	f := cmd.Flags()

	f.StringVar(&device, "device", "", "GPU ordinal or UUID (default: the daemon's first device)")
	f.StringVar(&mode, "mode", "", "permission bits in octal (default 0600)")
	f.StringVar(&meta, "meta", "", "user metadata, a JSON value")
	f.BoolVar(&existOK, "exist-ok", false, "succeed if the segment exists with the same size and device")
	f.BoolVar(&offer, "offer", false, "offer it to the daemon's peers on other nodes (docs/peers.md)")
	f.BoolVar(&persist, "persist", false, "make it durable: 'gpushm sync' writes its bytes to the daemon's disk tier, and it is listed again after a reboot (docs/disk.md)")
	f.BoolVar(&pin, "pin", false, "keep the segment on its device: never evict it to host memory when the device's budget needs room ('gpushm unpin' lets it go)")
	f.DurationVar(&ttl, "ttl", 0, "remove the segment once nobody has had it open for this long (e.g. 10m)")
	addOutput(cmd, false)
	return cmd
}

func create(cmd *cobra.Command, name, sizeArg, device, mode, meta string, existOK, pin, persist, offer bool, ttl time.Duration) error {
	size, err := bytesize.Parse(sizeArg)
	if err != nil {
		return exitcode.Usagef(cmd, "create %s: %v", name, err)
	}
	if size == 0 {
		// The protocol makes an empty segment only when asked to: one
		// holds nothing to map, and a size of 0 typed here is a mistake.
		return exitcode.Usagef(cmd, "create %s: invalid size: 0 (must be positive; an empty file puts as an empty segment, which holds nothing to map)", name)
	}
	o := &gpushm.CreateOptions{ExistOK: existOK, TTL: ttl, Pin: pin, Persist: persist, Offer: offer}
	if o.Mode, err = parseMode(cmd, mode); err != nil {
		return err
	}
	if meta != "" {
		if !json.Valid([]byte(meta)) {
			return exitcode.Usagef(cmd, "--meta: not valid JSON")
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
	inf, created, err := c.CreateOnly(cmd.Context(), name, size, o)
	if err != nil {
		return err
	}
	switch {
	case structured():
		return printValue(report.SegmentOf(inf))
	case output == "name":
		printNames(inf.Name)
		return nil
	}
	verb := "created"
	if !created {
		verb = "exists:"
	}
	fmt.Fprintf(Stdout, "%s %s: %s on device %d (allocated %s)\n", verb, inf.Name, bytesize.Format(inf.Size), inf.Device, bytesize.Format(inf.AllocSize))
	return nil
}

// parseMode reads --mode: octal permission bits, or "" for the default.
func parseMode(cmd *cobra.Command, mode string) (*uint32, error) {
	if mode == "" {
		return nil, nil
	}
	m, err := strconv.ParseUint(mode, 8, 32)
	if err != nil || m > 0o777 {
		return nil, exitcode.Usagef(cmd, "%s: --mode %q: want octal permission bits such as 0640", cmd.Name(), mode)
	}
	m32 := uint32(m)
	return &m32, nil
}
