package peer

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"syscall"
)

// MinSecret is the shortest secret LoadSecret accepts: 32 bytes, the size
// of the HMAC-SHA256 key it becomes, so that guessing it costs as much as
// guessing the key.
const MinSecret = 32

// maxSecret bounds the file LoadSecret reads: a secret is a line of
// random characters, not a file that may be anything.
const maxSecret = 4096

// LoadSecret reads the peers' shared secret from path. The file must be a
// regular file (not a symbolic link) owned by the user running the daemon,
// that nobody else may read or write (mode 0600 or 0400), holding at least
// MinSecret bytes once surrounding white space is trimmed. Each refusal
// says what to change.
func LoadSecret(path string) ([]byte, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_NONBLOCK|syscall.O_CLOEXEC, 0)
	if errors.Is(err, syscall.ELOOP) {
		return nil, fmt.Errorf("peer secret %s: is a symbolic link; name the file itself", path)
	}
	if err != nil {
		return nil, fmt.Errorf("peer secret: %w", err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("peer secret: %w", err)
	}
	if !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("peer secret %s: not a regular file (%s)", path, fi.Mode().Type())
	}
	if perm := fi.Mode().Perm(); perm&0o077 != 0 {
		return nil, fmt.Errorf("peer secret %s: mode %04o lets others read or write it; chmod 600 %s", path, perm, path)
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok && int(st.Uid) != os.Geteuid() {
		return nil, fmt.Errorf("peer secret %s: owned by uid %d, not by this daemon's user (uid %d)", path, st.Uid, os.Geteuid())
	}
	b, err := io.ReadAll(io.LimitReader(f, maxSecret+1))
	if err != nil {
		return nil, fmt.Errorf("peer secret: read %s: %w", path, err)
	}
	if len(b) > maxSecret {
		return nil, fmt.Errorf("peer secret %s: longer than %d bytes; a secret is one line", path, maxSecret)
	}
	b = bytes.TrimSpace(b)
	if len(b) < MinSecret {
		return nil, fmt.Errorf("peer secret %s: %d bytes, at least %d needed (e.g. head -c 48 /dev/urandom | base64 > %s)", path, len(b), MinSecret, path)
	}
	return b, nil
}
