# kvmesh — `make help` lists the targets.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
export PATH := /usr/local/go/bin:$(PATH)
# go-nvml's C code warns about deprecated declarations; nothing to act on.
export CGO_CFLAGS ?= -O2 -g -Wno-deprecated-declarations

GO        ?= go
DEV       := .dev
BIN       := bin
FUZZTIME  ?= 10s
# Packages whose tests run under the race detector (all of them: every
# package with goroutines is in this list; the race run is the only run).
PKGS      := ./...
SERVICES  := lookup scheduler sender gpuworker

.DEFAULT_GOAL := help

.PHONY: help
help: ## List the targets.
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-11s %s\n", $$1, $$2}'

.PHONY: build
build: ## Build the four services and the kvmesh CLI into bin/.
	@mkdir -p $(BIN)
	$(GO) build -o $(BIN)/ ./cmd/kvmesh $(addprefix ./services/,$(SERVICES))

.PHONY: deps
deps: ## Start (or reuse) the local PostgreSQL and Redis; writes .dev/env.
	@scripts/devstack.sh up >/dev/null

.PHONY: up
up: build deps ## Start the broker and the four services in the background (logs in .dev/logs).
	@scripts/stack.sh up

.PHONY: down
down: ## Stop everything `make up` / `make run` / `make test` started.
	@scripts/stack.sh down || true
	@scripts/devstack.sh down

.PHONY: run
run: up ## The main job: the stack, the demo workload (seed preset) and its report; the stack stays up.
	@scripts/run.sh $(RUN_ARGS)

.PHONY: traces
traces: build deps ## Build Jaeger v2 once into .dev/bin (5-17 min), run the stack and a 20-request sim exporting to it, check one trace per request through all four services.
	@scripts/traces.sh

.PHONY: test
# The service binaries that the kill and end-to-end tests run are built
# once, with -race (so they share the compiled dependencies with the test
# binaries, and a data race in a service process stops it: GORACE below).
TESTBIN   := $(DEV)/testbin
# Fuzz targets that `make test` runs for FUZZTIME; `make fuzz` runs them all.
TESTFUZZ  := ./services/scheduler/requeststate

# The vLLM connector's Python tests run on Debian's interpreter (the
# packages scripts/pydeps.sh installs are for it, not for a pyenv python3 on
# PATH), from the repository root, writing no __pycache__ or .pytest_cache
# into the checkout. The mesh tests (PYTESTS/mesh) need a running stack:
# TestVLLMConnector (e2e/) starts one and runs them.
PYTHON    := /usr/bin/python3
PYTESTS   := connectors/vllm/tests
PYTEST    := PYTHONPATH=$(CURDIR)/connectors/vllm PYTHONDONTWRITEBYTECODE=1 $(PYTHON) -m pytest -q -p no:cacheprovider

# KVMESH_REQUIRE_PYTHON=1: a Go test that needs the Python packages fails
# instead of skipping without them (python-deps installed them first).
test: deps test-python ## All tests against real PostgreSQL, Redis and the embedded broker, race detector on, the connector's Python tests, plus bounded fuzzing of the domain core.
	@mkdir -p $(TESTBIN) && $(GO) build -race -o $(TESTBIN)/ $(addprefix ./services/,$(SERVICES))
	@source $(DEV)/env && KVMESH_REQUIRE_SERVICES=1 KVMESH_REQUIRE_PYTHON=1 KVMESH_TEST_BIN_DIR=$(CURDIR)/$(TESTBIN) GORACE=halt_on_error=1 \
		$(GO) test -race -count=1 -timeout 18m $(PKGS)
	@source $(DEV)/env && KVMESH_REQUIRE_SERVICES=1 scripts/fuzz.sh $(FUZZTIME) $(TESTFUZZ)

.PHONY: python-deps
python-deps: ## Install python3-confluent-kafka, -numpy, -pytest, -torch, -pip, -setuptools, -wheel and -venv for /usr/bin/python3 when missing (as root; else print the apt-get command and fail).
	@scripts/pydeps.sh

.PHONY: test-python
test-python: python-deps ## The vLLM connector's Python unit tests (connectors/vllm/tests; the mesh tests run in TestVLLMConnector, vLLM's scheduler tests in TestVLLMScheduler).
	$(PYTEST) $(PYTESTS) --ignore=$(PYTESTS)/mesh --ignore=$(PYTESTS)/vllm

.PHONY: fuzz
fuzz: deps ## Run every fuzz target (the request state machine's and the sender's) for FUZZTIME each (default 10s; e.g. make fuzz FUZZTIME=5m).
	@source $(DEV)/env && KVMESH_REQUIRE_SERVICES=1 scripts/fuzz.sh $(FUZZTIME)

.PHONY: bench
# Benchmarks run one package at a time (-p 1): they share PostgreSQL,
# Redis and the two cores, and the CPU-per-work figures read whole
# processes from /proc, which another package's benchmark would inflate.
bench: deps ## Go benchmarks into .dev/bench.txt, one package at a time, then the headline figures (each with its same-run baseline) into .dev/bench-report.txt.
	@mkdir -p $(DEV)
	@source $(DEV)/env && $(GO) test -p 1 -timeout 60m -run '^$$' -bench . -benchmem -count=1 $(PKGS) | tee $(DEV)/bench.txt
	@scripts/benchreport.sh $(DEV)/bench.txt $(DEV)/bench-report.txt

.PHONY: lint
lint: ## go vet, gofmt, and staticcheck when installed.
	$(GO) vet ./...
	@out=$$(gofmt -l .); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	@if command -v staticcheck >/dev/null; then staticcheck ./...; else echo "staticcheck not installed; skipped"; fi

.PHONY: docs
docs: ## Regenerate the configuration tables in docs/configuration.md from the services' Config structs.
	KVMESH_UPDATE_README=1 $(GO) test -p 1 -count=1 -run TestREADMEConfig ./services/...
