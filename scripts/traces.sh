#!/usr/bin/env bash
# traces.sh — `make traces`: the mesh's traces in a real trace backend.
#
#   1. builds Jaeger v2 (JAEGER_VERSION, default v1.76.0) from the Go module
#      proxy into .dev/bin/jaeger, once: in a throwaway module under
#      .dev/jaeger-build, never the project's go.mod (~120 MB, 5–17 minutes);
#   2. starts it on loopback only (.dev/jaeger.yaml: OTLP on 127.0.0.1:4317
#      and :4318, the query API and UI on 127.0.0.1:16686, in-memory storage);
#   3. starts the stack as `make up` does (scripts/stack.sh up), every service
#      exporting to it, and runs a short simulation (kvmesh sim, seed preset,
#      TRACES_REQUESTS requests, default 20) exporting to it too;
#   4. checks through Jaeger's query API that each request of the run is one
#      trace holding spans of all four services (TestJaegerTraces in e2e/);
#   5. stops the stack and Jaeger (not PostgreSQL and Redis).
#
# TRACES_KEEP=1 leaves the stack and Jaeger up for a look at
# http://127.0.0.1:16686 (stop them with scripts/stack.sh down and
# kill "$(cat .dev/pids/jaeger)"). Exits non-zero when a step or the check fails.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
dev="$root/.dev"
mkdir -p "$dev/logs" "$dev/pids" "$dev/bin"
cd "$root"
command -v go >/dev/null || export PATH=/usr/local/go/bin:$PATH

JAEGER_VERSION=${JAEGER_VERSION:-v1.76.0}
TRACES_REQUESTS=${TRACES_REQUESTS:-20}
jaeger="$dev/bin/jaeger"
query=http://127.0.0.1:16686

say() { printf 'traces: %s\n' "$*" >&2; }
die() { say "error: $*"; exit 1; }

# wait_for SECONDS CMD... polls CMD until it succeeds or the deadline passes.
wait_for() {
  local end=$((SECONDS + $1))
  shift
  until "$@" >/dev/null 2>&1; do
    [ $SECONDS -lt $end ] || return 1
    sleep 0.2
  done
}

in_use() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# build_jaeger builds .dev/bin/jaeger unless it is there.
build_jaeger() {
  if [ -x "$jaeger" ]; then return; fi
  local dir="$dev/jaeger-build" start=$SECONDS
  mkdir -p "$dir"
  say "building Jaeger $JAEGER_VERSION into .dev/bin/jaeger (once; 5-17 minutes; log: .dev/logs/jaeger-build.log)"
  (
    cd "$dir"
    export GOWORK=off GOFLAGS=-mod=mod
    [ -f go.mod ] || go mod init kvmesh-jaeger-build
    go get -tool "github.com/jaegertracing/jaeger/cmd/jaeger@$JAEGER_VERSION"
    go build -o "$jaeger.tmp" github.com/jaegertracing/jaeger/cmd/jaeger
  ) >"$dev/logs/jaeger-build.log" 2>&1 || die "Jaeger build failed; see .dev/logs/jaeger-build.log"
  mv "$jaeger.tmp" "$jaeger"
  say "Jaeger built in $((SECONDS - start))s"
}

# write_config writes Jaeger's all-in-one configuration (its embedded
# cmd/jaeger/internal/all-in-one.yaml) cut to OTLP and bound to 127.0.0.1:
# JAEGER_LISTEN_HOST alone would leave the query ports on all interfaces.
write_config() {
  cat >"$dev/jaeger.yaml" <<'YAML'
service:
  extensions: [jaeger_storage, jaeger_query, healthcheckv2]
  pipelines:
    traces:
      receivers: [otlp]
      processors: [batch]
      exporters: [jaeger_storage_exporter]
  telemetry:
    resource:
      service.name: jaeger
    metrics:
      level: none
    logs:
      level: info

extensions:
  jaeger_query:
    storage:
      traces: some_storage
    http:
      endpoint: 127.0.0.1:16686
    grpc:
      endpoint: 127.0.0.1:16685

  jaeger_storage:
    backends:
      some_storage:
        memory:
          max_traces: 100000

  healthcheckv2:
    use_v2: true
    http:
      endpoint: 127.0.0.1:13133

receivers:
  otlp:
    protocols:
      grpc:
        endpoint: 127.0.0.1:4317
      http:
        endpoint: 127.0.0.1:4318

processors:
  batch:

exporters:
  jaeger_storage_exporter:
    trace_storage: some_storage
YAML
}

jaeger_running() { [ -f "$dev/pids/jaeger" ] && kill -0 "$(cat "$dev/pids/jaeger")" 2>/dev/null; }

start_jaeger() {
  local p
  for p in 4317 4318 16685 16686 13133; do
    in_use "$p" && die "port $p is in use (another Jaeger or collector?); stop it first"
  done
  write_config
  nohup "$jaeger" --config "file:$dev/jaeger.yaml" >"$dev/logs/jaeger.log" 2>&1 &
  echo $! >"$dev/pids/jaeger"
  wait_for 60 curl -sf "$query/api/services" || die "Jaeger did not come up; see .dev/logs/jaeger.log"
  say "Jaeger up: OTLP on 127.0.0.1:4317/4318, query API and UI on $query"
}

stop_jaeger() {
  jaeger_running || { rm -f "$dev/pids/jaeger"; return 0; }
  local pid
  pid=$(cat "$dev/pids/jaeger")
  kill -TERM "$pid" 2>/dev/null || true
  wait_for 10 bash -c "! kill -0 $pid" || kill -KILL "$pid" 2>/dev/null || true
  rm -f "$dev/pids/jaeger"
  say "Jaeger stopped"
}

cleanup() {
  local status=$?
  if [ "${TRACES_KEEP:-}" = 1 ]; then
    say "TRACES_KEEP=1: the stack and Jaeger stay up ($query)"
  else
    "$root/scripts/stack.sh" down || true
    stop_jaeger
  fi
  exit "$status"
}

main() {
  local start=$SECONDS
  command -v curl >/dev/null || die "curl is needed"
  [ -f "$dev/env" ] || die "run scripts/devstack.sh up first (make traces does)"
  # A stack already up was started without the exporter: its services'
  # spans would not reach Jaeger.
  if compgen -G "$dev/pids/*" >/dev/null; then
    local f
    for f in "$dev"/pids/*; do
      # The background versitygw build (scripts/s3server.sh build-bg, which
      # `make deps` starts) is no stack service.
      [ "$(basename "$f")" != versitygw-build ] || continue
      kill -0 "$(cat "$f")" 2>/dev/null &&
        die "$(basename "$f") is already running (scripts/stack.sh status); stop it first: scripts/stack.sh down"
    done
  fi
  build_jaeger
  trap cleanup EXIT
  start_jaeger

  export OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4318 OTEL_BSP_SCHEDULE_DELAY=500
  unset OTEL_EXPORTER_OTLP_TRACES_ENDPOINT
  "$root/scripts/stack.sh" up

  local tag since
  tag="traces-$(od -An -N3 -tx1 /dev/urandom | tr -d ' \n')"
  since=$(($(date +%s) * 1000000))
  # shellcheck disable=SC1091
  KVMESH_REDIS_URL=$(source "$dev/env" && echo "${KVMESH_REDIS_URL:-}")
  say "simulating $TRACES_REQUESTS requests (seed preset, run $tag)"
  # The model and layout the stack serves (stack.sh up recorded them).
  local env
  env=$("$root/scripts/stack.sh" env)
  eval "$env"
  KVMESH_REDIS_URL=$KVMESH_REDIS_URL "$root/bin/kvmesh" sim --preset seed --model "$KVMESH_MODEL" ${KVMESH_TP:+--tp "$KVMESH_TP"} \
    --requests "$TRACES_REQUESTS" --run-tag "$tag" --progress off >"$dev/logs/traces-sim.txt" ||
    die "the simulation failed; see .dev/logs/traces-sim.txt"

  say "checking the run's traces through Jaeger's query API"
  KVMESH_JAEGER_URL=$query KVMESH_JAEGER_RUN_TAG=$tag KVMESH_JAEGER_REQUESTS=$TRACES_REQUESTS \
    KVMESH_JAEGER_SINCE=$since go test -count=1 -run '^TestJaegerTraces$' -v ./e2e/
  say "done in $((SECONDS - start))s; open $query/search?service=kvmesh-sim with TRACES_KEEP=1 to look"
}

main "$@"
