package report

import (
	"fmt"
	"io"
	"os"
	"time"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/bytesize"
	"github.com/gpushm/gpushm/internal/terminal"
)

// Removed is what rm says of a name with -o json or yaml.
type Removed struct {
	Name string `json:"name"`
	// Removed is false for a name that did not exist, with --force.
	Removed bool `json:"removed"`
}

// Copy is what put and get say with -o json and -o yaml.
type Copy struct {
	Name string `json:"name"`
	// File is the file, or the directory, copied from or to: "-" for
	// standard input or output.
	File    string  `json:"file"`
	Bytes   int64   `json:"bytes"`
	Seconds float64 `json:"seconds"`
	// Copier is who copied: "daemon" or "client" (this process).
	Copier string `json:"copier"`
	// CRC32C is the file's CRC-32C as put recorded it in the bundle's
	// origin (safetensors files read by name).
	CRC32C string `json:"crc32c,omitempty"`
	// Segment is the segment put made, as committed.
	Segment *Segment `json:"segment,omitempty"`
}

// Finish sets the time the copy took, since start.
func (r *Copy) Finish(start time.Time) { r.Seconds = time.Since(start).Seconds() }

// Rate writes to w, when it is a terminal or with verbose, the whole
// command's rate: n bytes in d; and with verbose how the copy went.
func Rate(w io.Writer, verb, name string, n int64, d time.Duration, st gpushm.CopyStats, verbose bool) {
	if f, ok := w.(*os.File); !verbose && (!ok || !terminal.Is(f)) {
		return
	}
	fmt.Fprintf(w, "%s %s: %s in %.3fs (%.2f GB/s)\n", verb, name, bytesize.Format(n), d.Seconds(), float64(n)/d.Seconds()/1e9)
	if verbose && st.Elapsed > 0 {
		chunks := ""
		if st.Chunk > 0 { // the daemon's copies do not say
			chunks = ", " + bytesize.Format(st.Chunk) + " chunks"
		}
		fmt.Fprintf(w, "%s %s: copy %s in %.3fs (%.2f GB/s), %s with O_DIRECT, %d copiers%s\n",
			verb, name, bytesize.Format(st.Bytes), st.Elapsed.Seconds(), float64(st.Bytes)/st.Elapsed.Seconds()/1e9,
			bytesize.Format(st.Direct), st.Workers, chunks)
	}
}
