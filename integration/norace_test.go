//go:build !race

package integration

// raceBuild: see race_test.go.
const raceBuild = false
