package testdaemon

import (
	"hash/crc32"
	"os"
	"syscall"
	"testing"
)

// Stat is what put should record of a file (docs/protocol.md, "Where a
// bundle came from"), found here without the code that records it: what
// os.Stat, following links, says of the file now, and the CRC-32C of its
// bytes.
type Stat struct {
	Size, MtimeNS, CtimeNS int64
	Dev, Ino               uint64
	CRC32C                 uint32
}

// StatFile is Stat of the file at path.
func StatFile(t testing.TB, path string) Stat {
	t.Helper()
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	st := fi.Sys().(*syscall.Stat_t)
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return Stat{Size: fi.Size(), MtimeNS: st.Mtim.Nano(), CtimeNS: st.Ctim.Nano(), Dev: uint64(st.Dev), Ino: st.Ino,
		CRC32C: crc32.Checksum(b, crc32.MakeTable(crc32.Castagnoli))}
}
