# kproxy Makefile. `make test` runs everything CI runs; `make bench` measures.
SHELL := /bin/bash
export PATH := /usr/local/go/bin:$(PATH)
GO ?= go
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
LDFLAGS := -X github.com/kproxy/kproxy/cmd/kproxy/app.Version=$(VERSION)
BENCH_SERVICES ?= 1000 10000

.PHONY: all build deps test unit lint bench clean image

all: build

deps:
	hack/install-deps.sh

build:
	$(GO) build -ldflags '$(LDFLAGS)' -o bin/kproxy ./cmd/kproxy

lint:
	@out=$$(gofmt -l cmd pkg proxier config hack test 2>/dev/null); \
	if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...

# Unit, fake-backend, fuzz-seed and real-kernel (network namespace) tests.
# Real-kernel tests need root; they skip otherwise.
test: deps lint build
	$(GO) test -race -count=1 ./...

# Real iptables-restore in a throwaway network namespace (needs root). Each
# size's peak memory is measured in a process of its own.
bench: deps
	KPROXY_BENCH_SERVICES="$(BENCH_SERVICES)" $(GO) test -run '^$$' -bench 'Sync$$|PartialSyncCPU' -benchtime 1x -timeout 60m ./proxier/iptables/
	for n in $(BENCH_SERVICES); do \
	  KPROXY_BENCH_SERVICES=$$n $(GO) test -run '^$$' -bench 'Memory' -benchtime 1x -timeout 30m ./proxier/iptables/ || exit 1; \
	done

image:
	docker build -t kproxy:$(VERSION) .

clean:
	rm -rf bin
