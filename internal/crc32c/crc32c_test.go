package crc32c

import (
	"hash/crc32"
	"math/rand/v2"
	"slices"
	"strconv"
	"testing"
)

// TestCombine splits random data at random places, in random numbers of
// pieces, and checks that combining the pieces' checksums gives the whole
// data's, as hash/crc32 computes it.
func TestCombine(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	want := crc32.MakeTable(crc32.Castagnoli)
	for i := range 500 {
		n := r.IntN(1 << 14)
		if i%50 == 0 {
			n = r.IntN(4 << 20) // pieces longer than 2^k for every small k
		}
		b := make([]byte, n)
		for j := range b {
			b[j] = byte(r.Uint32())
		}
		cuts := []int{0, n}
		for range r.IntN(8) {
			cuts = append(cuts, r.IntN(n+1))
		}
		slices.Sort(cuts)
		var got uint32
		for j := 1; j < len(cuts); j++ {
			piece := b[cuts[j-1]:cuts[j]]
			got = Combine(got, Checksum(piece), int64(len(piece)))
		}
		if w := crc32.Checksum(b, want); got != w {
			t.Fatalf("%d bytes cut at %v: combined %08x, want %08x", n, cuts, got, w)
		}
	}
}

// TestCombineLong combines a piece of 512 MiB and more, past the lengths
// a table of x^(2^k) of 32 entries serves (zlib's wraps there, which for
// Castagnoli's polynomial is wrong). The long piece is zeros but for its
// ends, so that reading it costs no memory: its pages are the zero page.
func TestCombineLong(t *testing.T) {
	a := []byte("a piece before")
	for _, n := range []int{1 << 29, 1<<29 + 1, 3<<29 + 12345} {
		b := make([]byte, n)
		b[0], b[n-1] = 1, 2
		want := crc32.Update(crc32.Checksum(a, Table), Table, b)
		if got := Combine(Checksum(a), Checksum(b), int64(n)); got != want {
			t.Errorf("Combine over %d bytes = %08x, want %08x", n, got, want)
		}
	}
}

// TestCombineKnown checks against the standard check value and a
// split of it.
func TestCombineKnown(t *testing.T) {
	const check = 0xe3069283 // CRC-32C of "123456789"
	if got := Checksum([]byte("123456789")); got != check {
		t.Fatalf("Checksum(123456789) = %08x, want %08x", got, check)
	}
	if got := Combine(Checksum([]byte("1234")), Checksum([]byte("56789")), 5); got != check {
		t.Fatalf("Combine(1234, 56789) = %08x, want %08x", got, check)
	}
	if got := Combine(check, 0, 0); got != check {
		t.Fatalf("Combine(x, empty) = %08x, want %08x", got, check)
	}
	if got := Combine(0, check, 9); got != check {
		t.Fatalf("Combine(empty, x) = %08x, want %08x", got, check)
	}
}

func TestFormatParse(t *testing.T) {
	for _, c := range []uint32{0, 1, 0xe3069283, 0xffffffff} {
		s := Format(c)
		got, err := Parse(s)
		if len(s) != 8 || err != nil || got != c {
			t.Errorf("Parse(Format(%#x) = %q) = %#x, %v", c, s, got, err)
		}
	}
	for _, s := range []string{"", "0", "E3069283", "e306928", "e30692830", "+3069283", "g3069283"} {
		if _, err := Parse(s); err == nil {
			t.Errorf("Parse(%q) succeeded", s)
		}
	}
}

// FuzzCombine checks Combine against hash/crc32 on the fuzzer's data cut
// at the fuzzer's place.
func FuzzCombine(f *testing.F) {
	f.Add([]byte("123456789"), uint(4))
	f.Add([]byte{}, uint(0))
	f.Add(make([]byte, 1000), uint(999))
	tab := crc32.MakeTable(crc32.Castagnoli)
	f.Fuzz(func(t *testing.T, b []byte, cut uint) {
		k := int(cut % uint(len(b)+1))
		got := Combine(Checksum(b[:k]), Checksum(b[k:]), int64(len(b)-k))
		if w := crc32.Checksum(b, tab); got != w {
			t.Fatalf("%d bytes cut at %d: combined %08x, want %08x", len(b), k, got, w)
		}
	})
}

// BenchmarkChecksum is the hash's speed on a copier's chunk (8 MiB,
// mostly out of cache) and on a piece that stays in cache.
func BenchmarkChecksum(b *testing.B) {
	for _, n := range []int{256 << 10, 8 << 20} {
		buf := make([]byte, n)
		b.Run(strconv.Itoa(n>>10)+"KiB", func(b *testing.B) {
			b.SetBytes(int64(n))
			for b.Loop() {
				Checksum(buf)
			}
		})
	}
}
