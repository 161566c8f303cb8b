package peer

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestLoadSecret(t *testing.T) {
	dir := t.TempDir()
	good := strings.Repeat("s", MinSecret)
	write := func(name, content string, mode os.FileMode) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(content), mode); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(p, mode); err != nil {
			t.Fatal(err)
		}
		return p
	}
	ok := write("ok", good+"\n", 0o600)
	if s, err := LoadSecret(ok); err != nil || string(s) != good {
		t.Fatalf("LoadSecret(0600 file) = %q, %v; want the secret without its newline", s, err)
	}
	if _, err := LoadSecret(write("ro", good, 0o400)); err != nil {
		t.Errorf("LoadSecret(0400 file) = %v", err)
	}
	link := filepath.Join(dir, "link")
	if err := os.Symlink(ok, link); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name, path, want string
	}{
		{"readable by all", write("0644", good, 0o644), "mode 0644"},
		{"writable by the group", write("0620", good, 0o620), "mode 0620"},
		{"a symbolic link", link, "symbolic link"},
		{"short", write("short", strings.Repeat("s", MinSecret-1)+"\n", 0o600), "31 bytes, at least 32"},
		{"a directory", dir, "not a regular file"},
		{"missing", filepath.Join(dir, "none"), "no such file"},
	}
	if os.Geteuid() == 0 {
		other := write("other", good, 0o600)
		if err := os.Chown(other, 65534, 65534); err != nil {
			t.Fatal(err)
		}
		tests = append(tests, struct{ name, path, want string }{"another user's", other, "owned by uid 65534"})
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s, err := LoadSecret(tc.path)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("LoadSecret(%s) = %q, %v; want an error saying %q", tc.path, s, err, tc.want)
			}
		})
	}
}
