package wire

import oldrand "math/rand"

// testing/quick takes a math/rand (v1) generator.
type oldRand = oldrand.Rand

func newOldRand(seed int64) *oldRand { return oldrand.New(oldrand.NewSource(seed)) }
