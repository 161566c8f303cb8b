// Package crc32c is CRC-32C (Castagnoli), the content hash put records for
// every file it copies: hash/crc32's checksum (SSE4.2 or ARMv8 CRC
// instructions where the CPU has them), and Combine, which makes the
// checksum of a whole file from those of its chunks, so that copiers that
// read chunks in parallel, in any order, never read a byte twice.
package crc32c

import (
	"fmt"
	"hash/crc32"
	"strconv"
)

// Table is the Castagnoli table of hash/crc32.
var Table = crc32.MakeTable(crc32.Castagnoli)

// Checksum is the CRC-32C of b.
func Checksum(b []byte) uint32 { return crc32.Checksum(b, Table) }

// Update returns the CRC-32C of the bytes crc was the checksum of,
// followed by b.
func Update(crc uint32, b []byte) uint32 { return crc32.Update(crc, Table, b) }

// poly is the Castagnoli polynomial, reflected, as hash/crc32 uses it.
const poly = 0x82f63b78

// multModP is a·b modulo the polynomial, in the reflected bit order of
// the checksum (the top bit is x^0), as zlib's multmodp.
func multModP(a, b uint32) uint32 {
	m := uint32(1) << 31
	var p uint32
	for {
		if a&m != 0 {
			p ^= b
			if a&(m-1) == 0 {
				return p
			}
		}
		m >>= 1
		if b&1 != 0 {
			b = b>>1 ^ poly
		} else {
			b >>= 1
		}
	}
}

// x2n[k] is x^(2^k) modulo the polynomial, for every k x2nModP meets:
// from 3 (bytes to bits) up to 3+63 (a length of 63 bits). zlib's table
// has 32 entries and wraps k at 32, since x^(2^32) is x modulo its
// polynomial; modulo Castagnoli's it is not, and a wrapped table combined
// wrongly wherever B is 512 MiB or more.
var x2n = func() (t [3 + 64]uint32) {
	p := uint32(1) << 30 // x^1
	t[0] = p
	for k := 1; k < len(t); k++ {
		p = multModP(p, p)
		t[k] = p
	}
	return t
}()

// x2nModP is x^(n·2^k) modulo the polynomial.
func x2nModP(n uint64, k uint) uint32 {
	p := uint32(1) << 31 // x^0
	for n != 0 {
		if n&1 != 0 {
			p = multModP(x2n[k], p)
		}
		n >>= 1
		k++
	}
	return p
}

// Combine returns the CRC-32C of A followed by B, given crc1, the CRC-32C of
// A, and crc2, that of B, len2 bytes long: zlib's crc32_combine, with
// Castagnoli's polynomial. It takes time logarithmic in len2, and none of
// the bytes. A negative len2 counts as 0.
func Combine(crc1, crc2 uint32, len2 int64) uint32 {
	if len2 <= 0 {
		return crc1 // B is empty
	}
	return multModP(x2nModP(uint64(len2), 3), crc1) ^ crc2
}

// Format writes crc as put records it: 8 lowercase hexadecimal digits.
func Format(crc uint32) string { return fmt.Sprintf("%08x", crc) }

// Parse reads what Format writes.
func Parse(s string) (uint32, error) {
	if len(s) != 8 {
		return 0, fmt.Errorf("crc32c %q: want 8 hexadecimal digits", s)
	}
	for _, c := range s {
		if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f') {
			return 0, fmt.Errorf("crc32c %q: want 8 lowercase hexadecimal digits", s)
		}
	}
	n, err := strconv.ParseUint(s, 16, 32)
	if err != nil {
		return 0, fmt.Errorf("crc32c %q: %w", s, err)
	}
	return uint32(n), nil
}
