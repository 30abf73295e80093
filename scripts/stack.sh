#!/usr/bin/env bash
# stack.sh — the embedded kvmesh stack in the background: the Kafka-protocol
# broker (kvmesh devbroker) and the four services, built into bin/ by `make build`.
#
#   scripts/stack.sh up      start what is not running; wait until every /readyz is 200
#   scripts/stack.sh down    stop them (SIGTERM, then SIGKILL after 10 s)
#   scripts/stack.sh status  one line per service with its readiness
#
# PostgreSQL and Redis come from scripts/devstack.sh (.dev/env). Logs and pids
# live in .dev/logs and .dev/pids.
#
# KVMESH_ENGINES=N (default 1) starts a fleet of N engine pairs for
# `kvmesh sim --engines N`: each decode engine decode-i and its prefill
# engine prefill-i get a gpuworker of their own, at :8084+2i and :8085+2i
# (decode-0 :8084, prefill-0 :8085, decode-1 :8086, prefill-1 :8087, …).
# `up` remembers N in .dev/engines, so that status, down, scripts/run.sh and
# scripts/demo.sh use it without the variable. Every process inherits the
# environment: e.g. KVMESH_POOL_BLOCKS=4096 sizes every gpuworker's pool
# (the long-context preset needs it; stop the stack first, a running
# gpuworker keeps its pool).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
dev="$root/.dev"
mkdir -p "$dev/logs" "$dev/pids"

say() { printf 'stack: %s\n' "$*" >&2; }
die() { say "error: $*"; exit 1; }

# engines: KVMESH_ENGINES, else what `up` last recorded, else 1.
engines=${KVMESH_ENGINES:-$(cat "$dev/engines" 2>/dev/null || echo 1)}
[[ $engines =~ ^[1-9][0-9]*$ ]] || die "KVMESH_ENGINES=$engines: want a positive number of engines"

# name:port of each process (the contract ports, docs/contract.md). The demo is the seed's
# setup: a 1P1D pair of engines, so two gpuworkers — decode-0 (the engine
# kvmesh serves, :8084) and prefill-0 (the engine whose KV decode-0 pulls
# through the pd connector, :8085) — and lookup's chain is pd,store. Engine
# pair i > 0 of a fleet (KVMESH_ENGINES) adds gpuworker-i (decode-i,
# :8084+2i) and gpuworker-prefill-i (prefill-i, :8085+2i).
services=(lookup:8081 scheduler:8082 sender:8083 gpuworker:8084 gpuworker-prefill:8085)
for ((i = 1; i < engines; i++)); do
  services+=("gpuworker-$i:$((8084 + 2 * i))" "gpuworker-prefill-$i:$((8085 + 2 * i))")
done

# binary NAME: the program a process runs.
binary() {
  case $1 in
    gpuworker*) echo gpuworker ;;
    *) echo "$1" ;;
  esac
}

# service_env NAME: the settings that differ per process (KVMESH_LOOKUP_CONNECTORS,
# KVMESH_DEV_DECODE_ENGINE and KVMESH_DEV_PREFILL_ENGINE override them, the
# latter two for engine pair 0).
service_env() {
  case $1 in
    lookup) echo "KVMESH_LOOKUP_CONNECTORS=${KVMESH_LOOKUP_CONNECTORS:-pd,store}" ;;
    gpuworker) echo "KVMESH_ENGINE_ID=${KVMESH_DEV_DECODE_ENGINE:-decode-0}" ;;
    gpuworker-prefill) echo "KVMESH_ENGINE_ID=${KVMESH_DEV_PREFILL_ENGINE:-prefill-0}" ;;
    gpuworker-prefill-*) echo "KVMESH_ENGINE_ID=prefill-${1##*-}" ;;
    gpuworker-*) echo "KVMESH_ENGINE_ID=decode-${1##*-}" ;;
  esac
}

running() { [ -f "$dev/pids/$1" ] && kill -0 "$(cat "$dev/pids/$1")" 2>/dev/null; }

free_port() {
  local p=$1
  while (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; do p=$((p + 1)); done
  echo "$p"
}

# wait_for DESC SECONDS CMD... polls CMD until it succeeds or the deadline passes.
wait_for() {
  local desc=$1 secs=$2
  shift 2
  local end=$((SECONDS + secs))
  until "$@" >/dev/null 2>&1; do
    [ $SECONDS -lt $end ] || return 1
    sleep 0.2
  done
}

broker_up() {
  if running broker; then return; fi
  local port
  port=$(free_port "${KVMESH_DEV_BROKER_PORT:-9092}")
  echo "127.0.0.1:$port" >"$dev/broker.addr"
  nohup "$root/bin/kvmesh" devbroker --addr "127.0.0.1:$port" --data-dir "$dev/broker" \
    >"$dev/logs/broker.log" 2>&1 &
  echo $! >"$dev/pids/broker"
  wait_for broker 30 grep -q '"broker ready"' "$dev/logs/broker.log" ||
    die "broker did not become ready; see $dev/logs/broker.log"
  say "broker ready on 127.0.0.1:$port"
}

service_up() {
  local name=$1 port=$2
  if running "$name"; then return; fi
  (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && die "port $port for $name is in use"
  # shellcheck disable=SC1091
  source "$dev/env"
  # shellcheck disable=SC2046
  env KVMESH_HTTP_ADDR="127.0.0.1:$port" \
    KVMESH_KAFKA_BROKERS="$(cat "$dev/broker.addr")" \
    KVMESH_ADMIN_TOKEN="${KVMESH_ADMIN_TOKEN:-$(cat "$dev/admin-token")}" \
    $(service_env "$name") \
    nohup "$root/bin/$(binary "$name")" >"$dev/logs/$name.log" 2>&1 &
  echo $! >"$dev/pids/$name"
}

# readyz PORT prints the HTTP status of GET /readyz on 127.0.0.1:PORT (000
# when nothing answers), with bash's /dev/tcp so that curl is not needed.
readyz() {
  local code=000
  if exec 3<>"/dev/tcp/127.0.0.1/$1" 2>/dev/null; then
    printf 'GET /readyz HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n' >&3
    read -r _ code _ <&3 || code=000
    exec 3<&-
  fi
  echo "${code:-000}"
}

ready() { [ "$(readyz "$1")" = 200 ]; }

up() {
  [ -f "$dev/env" ] || die "run scripts/devstack.sh up first (make up does)"
  [ -f "$dev/admin-token" ] || head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$dev/admin-token"
  broker_up
  echo "$engines" >"$dev/engines"
  local s
  for s in "${services[@]}"; do service_up "${s%%:*}" "${s##*:}"; done
  for s in "${services[@]}"; do
    wait_for "${s%%:*}" 60 ready "${s##*:}" ||
      die "${s%%:*} not ready on :${s##*:}; see $dev/logs/${s%%:*}.log"
  done
  say "all services ready ($engines engine pair(s): gpuworkers on :8084-:$((8085 + 2 * (engines - 1))))"
}

stop_one() {
  local name=$1 pid
  running "$name" || { rm -f "$dev/pids/$name"; return; }
  pid=$(cat "$dev/pids/$name")
  kill -TERM "$pid" 2>/dev/null || true
  wait_for "$name" 10 bash -c "! kill -0 $pid" || kill -KILL "$pid" 2>/dev/null || true
  rm -f "$dev/pids/$name"
  say "$name stopped"
}

down() {
  local s f
  for s in "${services[@]}"; do stop_one "${s%%:*}"; done
  # gpuworkers of a larger fleet than KVMESH_ENGINES says now
  for f in "$dev"/pids/gpuworker*; do
    if [ -e "$f" ]; then stop_one "$(basename "$f")"; fi
  done
  stop_one broker
}

status() {
  local s name port state
  printf '%-20s %-7s %-22s %s\n' SERVICE PID ADDRESS READY
  for s in broker:0 "${services[@]}"; do
    name=${s%%:*} port=${s##*:}
    pid=-
    running "$name" && pid=$(cat "$dev/pids/$name")
    if [ "$name" = broker ]; then
      state=$([ "$pid" != - ] && echo up || echo down)
      printf '%-20s %-7s %-22s %s\n' "$name" "$pid" "$(cat "$dev/broker.addr" 2>/dev/null || echo -)" "$state"
      continue
    fi
    state=$(readyz "$port")
    printf '%-20s %-7s %-22s %s\n' "$name" "$pid" "http://127.0.0.1:$port" "$state"
  done
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) status ;;
  *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
