package disk

import (
	"bytes"
	"testing"
	"time"

	"github.com/gpushm/gpushm/internal/crc32c"
)

func testManifest() *manifest {
	return &manifest{
		key: "a segment", meta: []byte(`{"owner":1000}`), gen: 42, size: 3*testChunk + 5,
		chunk: testChunk, align: 4096, written: time.Unix(0, 1700000000123456789),
		stripes: []dirID{{1}, {2}}, sums: []uint32{1, 2, 3, 4},
	}
}

func TestManifestRoundTrip(t *testing.T) {
	m := testManifest()
	b := m.encode()
	if int64(len(b)) != m.manifestLen() {
		t.Errorf("encode: %d bytes, manifestLen %d", len(b), m.manifestLen())
	}
	got, err := decodeManifest(b)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got.encode(), b) || got.key != m.key || !got.written.Equal(m.written) {
		t.Errorf("decodeManifest(encode(m)) = %+v, want %+v", got, m)
	}
}

// FuzzManifest feeds the decoder what a damaged or forged file may hold:
// it must never panic nor allocate beyond the limits, and whatever it
// accepts must encode back to the same bytes.
func FuzzManifest(f *testing.F) {
	m := testManifest()
	f.Add(m.encode())
	m.size, m.sums, m.stripes = 0, nil, m.stripes[:1]
	f.Add(m.encode())
	f.Add([]byte{})
	f.Add(manifestMagic[:])
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := decodeManifest(b)
		if err != nil {
			return
		}
		if !bytes.Equal(m.encode(), b) {
			t.Errorf("decodeManifest accepted bytes that do not encode back")
		}
		_ = m.footprint()
	})
}

func TestParseName(t *testing.T) {
	key, gen := "k", uint64(0x18ec1b308b0a35a1)
	for _, tc := range []struct {
		name string
		kind fileKind
	}{
		{manifestName(key, gen), kindManifest},
		{manifestName(key, gen) + tmpExt, kindTemp},
		{dataName(key, gen, 0), kindData},
		{dataName(key, gen, 255), kindData},
		{probePrefix + "123" + tmpExt, kindTemp},
		{idTmp, kindTemp},
		{idFile, foreign},
		{copyName(key, gen) + ".01.data", foreign},
		{copyName(key, gen) + ".256.data", foreign},
		{copyName(key, gen) + ".-1.data", foreign},
		{"lost+found", foreign},
		{"README", foreign},
	} {
		if got := parseName(tc.name).kind; got != tc.kind {
			t.Errorf("parseName(%q) = %v, want %v", tc.name, got, tc.kind)
		}
	}
}

func TestChecksum(t *testing.T) {
	for _, n := range []int64{0, 1, sumPiece, 2*sumPiece + 1, 64<<20 - 3} {
		b := pattern(n, 5)
		if got, want := checksum(b), crc32c.Checksum(b); got != want {
			t.Errorf("checksum of %d bytes = %08x, want %08x", n, got, want)
		}
	}
}
