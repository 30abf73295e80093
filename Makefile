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
	@grep -hE '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-11s %s\n", $$1, $$2}'

.PHONY: build
build: ## Build the four services and the kvmesh CLI into bin/.
	@mkdir -p $(BIN)
	$(GO) build -o $(BIN)/ ./cmd/kvmesh $(addprefix ./services/,$(SERVICES))

.PHONY: deps
# deps also starts building versitygw (the S3 server the tests run) into
# .dev/bin in the background, unless it is there: the build (~3-5 minutes
# of CPU) overlaps the Python tests, the race build and the tests that need
# no S3 server; a test that needs one waits for it (testenv.StartS3).
deps: ## Start (or reuse) the local PostgreSQL and Redis; writes .dev/env; builds versitygw into .dev/bin in the background.
	@scripts/devstack.sh up >/dev/null
	@scripts/s3server.sh build-bg

.PHONY: up
up: build deps ## Start the broker and the four services in the background (logs in .dev/logs).
	@scripts/stack.sh up

.PHONY: down
down: ## Stop everything `make up` / `make run` / `make test` started.
	@scripts/stack.sh down || true
	@scripts/s3server.sh down || true
	@scripts/devstack.sh down

.PHONY: run
# TIER=on: the stack with the capacity tier below Redis — the dev S3 server
# (scripts/s3server.sh up: versitygw, built once into .dev/bin) as the
# lookup's and the gpuworkers' KVMESH_TIER_*, Redis database 9 of the dev
# Redis (KVMESH_DEV_TIER_REDIS_DB) — then the demo as without it (unsalted,
# on a random workload seed), and, once the write-behind queues are empty,
# that Redis database flushed, the workload replayed on fresh engines and
# both runs' hit rates and tier loads compared (scripts/run.sh). A stack
# running in the other mode must be stopped first (make down). Without
# TIER, run is build, deps and what `make up` starts, as before.
run: build deps ## The main job: the stack, the demo workload (seed preset) and its report; the stack stays up. TIER=on: with the capacity tier (a dev S3 server), then Redis flushed and the workload replayed from the tier.
	@case "$(TIER)" in "" | on | off) ;; *) echo "TIER=$(TIER): want on or off" >&2; exit 2 ;; esac
	@$(if $(filter on,$(TIER)),scripts/s3server.sh up,true)
	@$(if $(TIER),KVMESH_DEV_TIER=$(TIER) )scripts/stack.sh up
	@$(if $(TIER),KVMESH_DEV_TIER=$(TIER) )scripts/run.sh $(RUN_ARGS)

.PHONY: s3server
s3server: ## Build versitygw once into .dev/bin and start a dev S3 server on 127.0.0.1:17070 (bucket kvmesh; KVMESH_DEV_TIER_* in .dev/env).
	@scripts/s3server.sh up

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
#
# The Python tests (one core) run beside the race build of the services.
test: deps python-deps ## All tests against real PostgreSQL, Redis and the embedded broker, race detector on, the connector's Python tests, plus bounded fuzzing of the domain core.
	@$(MAKE) --no-print-directory -j2 test-python race-bins
	@source $(DEV)/env && KVMESH_REQUIRE_SERVICES=1 KVMESH_REQUIRE_PYTHON=1 KVMESH_TEST_BIN_DIR=$(CURDIR)/$(TESTBIN) GORACE=halt_on_error=1 \
		$(GO) test -race -count=1 -timeout 18m $(PKGS)
	@source $(DEV)/env && KVMESH_REQUIRE_SERVICES=1 scripts/fuzz.sh $(FUZZTIME) $(TESTFUZZ)

.PHONY: race-bins
race-bins:
	@mkdir -p $(TESTBIN) && $(GO) build -race -o $(TESTBIN)/ $(addprefix ./services/,$(SERVICES))

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
