//go:build race

package integration

// raceBuild: the test binary has the race detector, so the gpushm that
// TestMain builds has it too, as the daemons had when they were this
// binary.
const raceBuild = true
