package layout

import (
	"os"

	"golang.org/x/sys/unix"
)

func fstat(f *os.File) (Identity, error) {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return Identity{}, err
	}
	return Identity{
		Size: st.Size, MtimeNS: unix.TimespecToNsec(st.Mtim), CtimeNS: unix.TimespecToNsec(st.Ctim),
		Dev: uint64(st.Dev), Ino: uint64(st.Ino),
	}, nil
}
