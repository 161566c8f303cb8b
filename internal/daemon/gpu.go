package daemon

import (
	"errors"
	"fmt"
	"log/slog"

	"github.com/gpushm/gpushm/internal/backend"
	"github.com/gpushm/gpushm/internal/gpuinfo"
	"github.com/gpushm/gpushm/internal/nvml"
)

// openGPUMonitor picks where the daemon's GPU figures come from. --nvml
// auto uses NVML when it loads and works, and otherwise serves without it,
// saying why in the log and in info; require refuses to start without it;
// off never loads it. The returned function releases NVML.
func openGPUMonitor(mode, library string, b backend.Backend, log *slog.Logger) (*gpuinfo.Monitor, func(), error) {
	nothing := func() {}
	switch mode {
	case "off":
		return gpuinfo.New(nil, b, "NVML off (--nvml off)"), nothing, nil
	case "auto", "require":
	default:
		return nil, nil, fmt.Errorf("--nvml %q: want auto, require or off", mode)
	}
	n, err := nvml.Open(library)
	if err != nil {
		if mode == "require" {
			return nil, nil, fmt.Errorf("--nvml require: %w (fix NVML, or start with --nvml auto to serve without it)", err)
		}
		without := "GPU memory figures from the CUDA driver, without utilisation or processes"
		if b.Name() != "cuda" {
			without = "no GPU figures"
		}
		note := err.Error()
		switch {
		case errors.Is(err, nvml.ErrUnavailable) && b.Name() != "cuda":
			// Expected on machines without a GPU.
			log.Debug("NVML not available", "reason", err)
		case errors.Is(err, nvml.ErrUnavailable):
			log.Info("NVML not available; serving with "+without, "reason", err)
		default:
			// The library is there but broken: worth an operator's look.
			note = "NVML failed: " + note
			log.Warn("NVML failed; serving without it, with "+without, "err", err)
		}
		return gpuinfo.New(nil, b, note), nothing, nil
	}
	log.Info("NVML", "library", library, "driver", n.Driver())
	return gpuinfo.New(n, b, ""), func() {
		if err := n.Close(); err != nil {
			log.Warn("NVML shutdown", "err", err)
		}
	}, nil
}
