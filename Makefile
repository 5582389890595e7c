# kproxy Makefile. `make test` runs everything CI runs; `make bench` measures.
SHELL := /bin/bash
export PATH := /usr/local/go/bin:$(PATH)
GO ?= go
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
LDFLAGS := -X github.com/kproxy/kproxy/cmd/kproxy/app.Version=$(VERSION)
BENCH_SERVICES ?= 1000 10000
# make bench's process benchmark: Node objects at the largest size (0: none)
# and proxy modes (a mode this kproxy rejects is reported as skipped).
BENCH_NODES ?= 5000
BENCH_MODES ?= iptables nftables
# make bench's nftables-mode shapes (services x endpoints) and the shapes
# whose peak memory is measured, each in a process of its own.
BENCH_NFT_SHAPES ?= 1000x10 10000x10 30000x10 45000x1 5000x50
BENCH_NFT_MEMORY ?= 10000x10

.PHONY: all build deps test unit e2e lint bench clean image demo demo-down control-plane kind-e2e

all: build

deps:
	hack/install-deps.sh

build:
	$(GO) build -ldflags '$(LDFLAGS)' -o bin/kproxy ./cmd/kproxy

lint:
	@out=$$(gofmt -l cmd pkg proxier config hack $$(ls -d test/* | grep -v _cache) 2>/dev/null); \
	if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...
	cd test && $(GO) vet ./...

# Everything CI runs: unit, fake-backend, fuzz-seed and real-kernel (network
# namespace) tests of the agent, then the local cluster's own tests and the
# e2e suite against a real control plane. Root-only tests skip otherwise.
test: deps lint build unit e2e

unit:
	$(GO) test -race -count=1 ./...
	@# IPVS, dummy devices and the rest of IPVS mode's kernel are missing here:
	@# those packages run again inside a qemu VM with Debian's kernel, where
	@# their real-kernel tests do not skip (hack/ipvs-vm.sh; no -race there).
	$(GO) test -count=1 -timeout 20m -exec "$(CURDIR)/hack/ipvs-vm.sh" ./pkg/ipvs/ ./pkg/netlink/ ./proxier/ipvs/

# The local cluster (test/LOCAL-CLUSTER.md): one cluster at a time on a
# machine: -p 1, and the e2e suite takes /tmp/kpc-cluster.lock itself. The
# suite runs once per proxy mode on one cluster, switching every node's
# kproxy between rounds: KPROXY_E2E_MODES (default "iptables nftables");
# a mode this kproxy or host cannot run is skipped, loudly.
e2e: deps
	@bin=$$(hack/build-control-plane.sh | tail -n 1) && cd test && \
	  KPC_BIN_DIR="$$bin" $(GO) test -count=1 -p 1 -timeout 60m ./...

control-plane:
	hack/build-control-plane.sh

# A real local cluster with kproxy routing real traffic; it stays up for you
# to explore until `make demo-down`.
# The demo cluster's processes keep /tmp/kpc-cluster.lock while it runs (so
# the e2e suite waits rather than tearing it down); running the demo again
# over its own cluster needs no lock.
demo: deps
	@bin=$$(hack/build-control-plane.sh | tail -n 1) && \
	  if flock -n /tmp/kpc-cluster.lock true; then \
	    KPC_BIN_DIR="$$bin" flock /tmp/kpc-cluster.lock "$$bin/kpc" demo; \
	  elif "$$bin/kpc" status >/dev/null 2>&1; then \
	    KPC_BIN_DIR="$$bin" "$$bin/kpc" demo; \
	  else \
	    echo "demo: /tmp/kpc-cluster.lock is held by another local cluster run (make test or make bench); run the demo when it ends" >&2; exit 1; \
	  fi

demo-down:
	@bin=$$(hack/build-control-plane.sh | tail -n 1) && "$$bin/kpc" down

# Real iptables-restore in a throwaway network namespace (needs root). Each
# size's peak memory is measured in a process of its own.
bench: deps
	KPROXY_BENCH_SERVICES="$(BENCH_SERVICES)" $(GO) test -run '^$$' -bench 'Sync$$|PartialSyncCPU' -benchtime 1x -timeout 60m ./proxier/iptables/
	for n in $(BENCH_SERVICES); do \
	  KPROXY_BENCH_SERVICES=$$n $(GO) test -run '^$$' -bench 'Memory' -benchtime 1x -timeout 30m ./proxier/iptables/ || exit 1; \
	done
	@# nftables mode: full sync, restarts, one-endpoint changes and a service
	@# added through the real nft in a throwaway network namespace, each
	@# against the same transaction replayed with nft -f, per shape.
	KPROXY_BENCH_SHAPES="$(BENCH_NFT_SHAPES)" $(GO) test -run '^$$' -bench 'NFTablesSync$$' -benchtime 1x -timeout 60m ./proxier/nftables/
	@# ... and 1,000 one-endpoint changes in a row per shape through the
	@# nft session: kproxy's and nft's CPU per change.
	KPROXY_BENCH_SHAPES="$(BENCH_NFT_SHAPES)" $(GO) test -run '^$$' -bench 'NFTablesChangeSteady$$' -benchtime 1000x -timeout 30m ./proxier/nftables/
	for s in $(BENCH_NFT_MEMORY); do \
	  KPROXY_BENCH_SHAPES=$$s $(GO) test -run '^$$' -bench 'NFTablesMemory' -benchtime 1x -timeout 30m ./proxier/nftables/ || exit 1; \
	done
	@# IPVS mode: full, restart and partial syncs into the real IPVS of the VM
	@# (TCG-emulated: slower than the same kernel on hardware).
	KPROXY_VM_MEM=2048 KPROXY_BENCH_SERVICES="$(BENCH_SERVICES)" $(GO) test -count=1 -run '^$$' -bench 'IPVSSync' -benchtime 1x \
	  -timeout 90m -exec "$(CURDIR)/hack/ipvs-vm.sh" ./proxier/ipvs/
	@# Network programming latency on the local cluster: API change -> traffic works.
	@set -o pipefail; mkdir -p _output && bin=$$(hack/build-control-plane.sh | tail -n 1) && cd test && \
	  KPC_BIN_DIR="$$bin" KPC_LATENCY_OUT="$(CURDIR)/_output/latency.json" \
	  $(GO) test -count=1 -run '^TestNetworkProgrammingLatency$$' -v -timeout 30m ./e2e/ | grep -E 'p50|p99|^(ok|FAIL|---)'
	@echo "latency samples: _output/latency*.json"
	@# The kproxy process against the local control plane's API server
	@# (test/procbench): first sync, write-to-kernel-commit time of one-endpoint
	@# changes, CPU per change and peak RSS, per mode and size, and again at the
	@# largest size with $(BENCH_NODES) Node objects.
	@mkdir -p _output && bin=$$(hack/build-control-plane.sh | tail -n 1) && cd test && \
	  KPROXY_PROCBENCH=1 KPC_BIN_DIR="$$bin" KPROXY_PROCBENCH_KPROXY="$$bin/kproxy" \
	  KPROXY_PROCBENCH_SERVICES="$(BENCH_SERVICES)" KPROXY_PROCBENCH_NODES="$(BENCH_NODES)" \
	  KPROXY_PROCBENCH_MODES="$(BENCH_MODES)" KPROXY_PROCBENCH_OUT="$(CURDIR)/_output/procbench.json" \
	  $(GO) test -count=1 -run '^TestProcessBenchmark$$' -v -timeout 120m ./procbench/

image:
	docker build -t kproxy:$(VERSION) .

# kproxy on a kind cluster without kube-proxy, with real pods
# (hack/kind-e2e.sh --help). Needs Docker and kind, so it is not part of
# `make test`. Extra flags: make kind-e2e KIND_E2E_FLAGS='--keep'.
kind-e2e:
	hack/kind-e2e.sh $(KIND_E2E_FLAGS)

clean:
	rm -rf bin
