// The module root for the per-minor go.<minor>.mod files: the oracle is built with
// go build -modfile=go.<minor>.mod (the Makefile's oracle target), never with this file.
module lowtail.test/kubelet-oracle

go 1.26.0
