package disk

import (
	"fmt"
	"strconv"
	"strings"
)

// The names of a store's files in each of its directories. h is the key's
// hash (keyHash), gen the copy's generation in 16 hex digits, j a stripe's
// index: every file of one copy starts "h-gen.".
const (
	idFile        = "gpushm-disk.id" // the directory's id, see dirID
	manifestExt   = ".manifest"      // h-gen.manifest
	tmpExt        = ".tmp"           // h-gen.manifest.tmp, a manifest not yet renamed; .probe-*.tmp
	dataExt       = ".data"          // h-gen.j.data
	probePrefix   = ".probe-"        // Open's check that the directory takes writes
	idTmp         = idFile + tmpExt  // the id file before its rename
	copyNameWidth = 32 + 1 + 16      // len("h-gen")
)

// copyName is the prefix of every file of a copy of key at gen.
func copyName(key string, gen uint64) string {
	return fmt.Sprintf("%s-%016x", keyHash(key), gen)
}

func manifestName(key string, gen uint64) string { return copyName(key, gen) + manifestExt }

func dataName(key string, gen uint64, stripe int) string {
	return fmt.Sprintf("%s.%d%s", copyName(key, gen), stripe, dataExt)
}

// A fileKind is what a name found in a directory is to the store.
type fileKind int

const (
	foreign      fileKind = iota // not the store's: left alone
	kindManifest                 // h-gen.manifest
	kindData                     // h-gen.j.data
	kindTemp                     // an interrupted write's: removed at Open
)

// parsed is a name of the store's, read back.
type parsed struct {
	kind   fileKind
	prefix string // h-gen
	hash   string
	gen    uint64
	stripe int
}

// parseName says what name is; names the store does not make are foreign.
func parseName(name string) parsed {
	if strings.HasPrefix(name, probePrefix) && strings.HasSuffix(name, tmpExt) || name == idTmp {
		return parsed{kind: kindTemp}
	}
	if len(name) < copyNameWidth {
		return parsed{}
	}
	p := parsed{prefix: name[:copyNameWidth], hash: name[:32]}
	if !isHex(p.hash) || name[32] != '-' || !isHex(name[33:copyNameWidth]) {
		return parsed{}
	}
	p.gen, _ = strconv.ParseUint(name[33:copyNameWidth], 16, 64)
	switch rest := name[copyNameWidth:]; {
	case rest == manifestExt:
		p.kind = kindManifest
	case rest == manifestExt+tmpExt:
		p.kind = kindTemp
	case strings.HasPrefix(rest, ".") && strings.HasSuffix(rest, dataExt):
		j, err := strconv.Atoi(strings.TrimSuffix(rest[1:], dataExt))
		if err != nil || j < 0 || j >= maxStripes || strconv.Itoa(j) != strings.TrimSuffix(rest[1:], dataExt) {
			return parsed{}
		}
		p.kind, p.stripe = kindData, j
	default:
		return parsed{}
	}
	return p
}

func isHex(s string) bool {
	for _, c := range []byte(s) {
		if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f') {
			return false
		}
	}
	return true
}
