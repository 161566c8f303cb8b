package xfer

import (
	"errors"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/gpushm/gpushm/internal/crc32c"
)

func TestNextStep(t *testing.T) {
	tests := []struct {
		k    int64
		d    time.Duration
		want int64
	}{
		{MinStep, 700 * time.Millisecond, MinStep},         // a cold disk: small steps
		{MinStep, 250 * time.Millisecond, MinStep},         // as meant
		{MinStep, 125 * time.Millisecond, 2 * MinStep},     // twice as fast
		{MinStep, 6 * time.Millisecond, 4 * MinStep},       // at most 4 times larger
		{1 << 30, 25 * time.Millisecond, MaxStep},          // at most MaxStep
		{MaxStep, time.Millisecond, MaxStep},               //
		{MinStep, 0, 4 * MinStep},                          // no time seen
		{100 << 20, 100 * time.Millisecond, MinStep},       // a last step, short
		{MinStep, 200 * time.Millisecond, 320 << 20},       // in whole MiB
		{MinStep, 190 * time.Millisecond, 336<<20 + 0<<20}, // 336.84 MiB, rounded down
	}
	for _, tc := range tests {
		if got := NextStep(tc.k, tc.d); got != tc.want {
			t.Errorf("NextStep(%d MiB, %s) = %d MiB (%d), want %d MiB", tc.k>>20, tc.d, got>>20, got, tc.want>>20)
		}
	}
}

// TestSteps: the steps cover the range once, in order; progress hears of
// each; the checksum is the whole range's, and none when a step has none.
func TestSteps(t *testing.T) {
	data := make([]byte, 3*MinStep+12345)
	rand.NewChaCha8([32]byte{}).Read(data)
	for _, hashing := range []bool{true, false} {
		var next, told int64
		steps := 0
		st, err := Steps(int64(len(data)), func(n int64) { told += n }, func(off, n int64) (Stats, error) {
			if off != next || n <= 0 || off+n > int64(len(data)) {
				t.Fatalf("step at %d of %d bytes, want one at %d within %d", off, n, next, len(data))
			}
			next += n
			steps++
			s := Stats{Bytes: n, Workers: 3}
			if hashing || steps == 1 {
				s.CRC32C = []uint32{crc32c.Checksum(data[off : off+n])}
			}
			return s, nil
		})
		if err != nil || next != int64(len(data)) || told != next || st.Bytes != next || st.Workers != 3 || steps < 2 {
			t.Fatalf("Steps: %+v, %v; copied %d of %d in %d steps, told %d", st, err, next, len(data), steps, told)
		}
		switch want := crc32c.Checksum(data); {
		case hashing && (len(st.CRC32C) != 1 || st.CRC32C[0] != want):
			t.Errorf("Steps' CRC-32C %x, want the whole range's, %x", st.CRC32C, want)
		case !hashing && st.CRC32C != nil:
			t.Errorf("Steps' CRC-32C %x, where a step had none", st.CRC32C)
		}
	}
	boom := errors.New("boom")
	if _, err := Steps(2*MinStep, nil, func(off, n int64) (Stats, error) {
		if off > 0 {
			return Stats{}, boom
		}
		return Stats{Bytes: n}, nil
	}); !errors.Is(err, boom) {
		t.Errorf("Steps with a failing step: %v", err)
	}
}
