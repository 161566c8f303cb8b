// Package deploy holds the tests of gpushm's deployment files: the
// Kubernetes manifests (decoded strictly into the Kubernetes API types, so
// that a typo fails) and the container image (built and run with podman).
// It is a module of its own so that the Kubernetes API types stay out of
// the gpushm module's dependencies; scripts/test runs its tests.
package deploy
