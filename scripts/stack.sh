#!/usr/bin/env bash
# stack.sh — the embedded kvmesh stack in the background: the Kafka-protocol
# broker (kvmesh devbroker) and the four services, built into bin/ by `make build`.
#
#   scripts/stack.sh up      start what is not running; wait until every /readyz is 200
#   scripts/stack.sh down    stop them (SIGTERM, then SIGKILL after 10 s)
#   scripts/stack.sh status  one line per service with its readiness
#   scripts/stack.sh env     the stack's layout as shell exports, for eval:
#                            KVMESH_ENGINES, KVMESH_MODEL, the recorded
#                            KVMESH_TP/PCP/DCP/PP and KVMESH_WORLD (gpuworkers
#                            per engine)
#
# PostgreSQL and Redis come from scripts/devstack.sh (.dev/env). Logs and pids
# live in .dev/logs and .dev/pids.
#
# The model is KVMESH_MODEL (default here hybrid-mla-linear-tp8: the seed's
# MLA + linear-attention model at TP8) with the KVMESH_TP/PCP/DCP/PP
# overrides; every engine runs one gpuworker per worker rank of it (W, from
# `kvmesh model --world-size`: 8 for the default).
#
# KVMESH_ENGINES=N (default 1) starts a fleet of N engine pairs for
# `kvmesh sim --engines N`: each decode engine decode-i and its prefill
# engine prefill-i. Rank k of decode-i listens on :8084+2iW+k, rank k of
# prefill-i on :8084+(2i+1)W+k — with W=1 decode-0 :8084, prefill-0 :8085,
# decode-1 :8086, …; with W=8 decode-0 :8084-:8091, prefill-0 :8092-:8099.
# `up` remembers N in .dev/engines, the model in .dev/model and the
# parallel overrides in .dev/parallel, so that status, down, scripts/run.sh
# and scripts/demo.sh use them without the variables; `down` forgets them. Every process inherits the environment: e.g.
# KVMESH_POOL_BLOCKS=4096 sizes every gpuworker's pool (the long-context
# preset needs it; stop the stack first, a running gpuworker keeps its
# pool), KVMESH_MODEL=hybrid-mla-linear KVMESH_TP=1 runs single-rank
# engines (the presets other than seed).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
dev="$root/.dev"
mkdir -p "$dev/logs" "$dev/pids"

say() { printf 'stack: %s\n' "$*" >&2; }
die() { say "error: $*"; exit 1; }

# engines: KVMESH_ENGINES, else what `up` last recorded, else 1.
engines=${KVMESH_ENGINES:-$(cat "$dev/engines" 2>/dev/null || echo 1)}
[[ $engines =~ ^[1-9][0-9]*$ ]] || die "KVMESH_ENGINES=$engines: want a positive number of engines"

# The model every process serves: KVMESH_MODEL, else what `up` last
# recorded, else the seed's; and its worker ranks ("tp pcp dcp pp" lines).
KVMESH_MODEL=${KVMESH_MODEL:-$(cat "$dev/model" 2>/dev/null || echo hybrid-mla-linear-tp8)}
export KVMESH_MODEL
# The parallel overrides `up` recorded, unless given now.
if [ "${1:-}" != up ] && [ -f "$dev/parallel" ]; then
  while read -r kv; do v=${kv%%=*}; [ -n "${!v:-}" ] || export "$kv"; done <"$dev/parallel"
fi
ranks=()
if [ -x "$root/bin/kvmesh" ]; then mapfile -t ranks < <("$root/bin/kvmesh" model --ranks); fi
if [ ${#ranks[@]} -eq 0 ]; then
  # up and env cannot go on without the layout; down and status still find every
  # worker through its pid file.
  case ${1:-} in up | env) die "cannot resolve the worker ranks of model $KVMESH_MODEL (bin/kvmesh model --ranks; make build first)" ;; esac
  ranks=("0 0 0 0")
fi
world=${#ranks[@]}

# name:port of each process (the contract ports, docs/contract.md). The demo
# is the seed's setup: a 1P1D pair of engines — decode-0 (the engine kvmesh
# serves) and prefill-0 (the engine whose KV decode-0 pulls through the pd
# connector) — each with one gpuworker per rank, and lookup's chain pd,store.
# Worker names: gpuworker (decode-0), gpuworker-prefill (prefill-0),
# gpuworker-i and gpuworker-prefill-i for pair i > 0; rank k > 0 of a
# multi-rank engine adds -rank<k> (gpuworker-rank3, gpuworker-prefill-1-rank7).
services=(lookup:8081 scheduler:8082 sender:8083)
worker_name() { # PAIR ROLE RANK
  local n=gpuworker
  [ "$2" = prefill ] && n+=-prefill
  [ "$1" -gt 0 ] && n+="-$1"
  [ "$3" -gt 0 ] && n+="-rank$3"
  echo "$n"
}
for ((i = 0; i < engines; i++)); do
  for role in decode prefill; do
    slot=$((2 * i)); [ $role = prefill ] && slot=$((2 * i + 1))
    for ((k = 0; k < world; k++)); do
      services+=("$(worker_name $i $role $k):$((8084 + slot * world + k))")
    done
  done
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
# latter two for engine pair 0): a gpuworker's engine id and rank.
service_env() {
  local name=$1 rank=0 pair=0 engine
  case $name in
    lookup) echo "KVMESH_LOOKUP_CONNECTORS=${KVMESH_LOOKUP_CONNECTORS:-pd,store}"; return ;;
    gpuworker*) ;;
    *) return ;;
  esac
  if [[ $name =~ -rank([0-9]+)$ ]]; then rank=${BASH_REMATCH[1]}; name=${name%-rank*}; fi
  if [[ $name =~ -([0-9]+)$ ]]; then pair=${BASH_REMATCH[1]}; fi
  case $name in
    gpuworker-prefill*) engine=${KVMESH_DEV_PREFILL_ENGINE:-prefill-0}; [ "$pair" -gt 0 ] && engine=prefill-$pair ;;
    *) engine=${KVMESH_DEV_DECODE_ENGINE:-decode-0}; [ "$pair" -gt 0 ] && engine=decode-$pair ;;
  esac
  local r=(${ranks[$rank]})
  echo "KVMESH_ENGINE_ID=$engine KVMESH_RANK_TP=${r[0]} KVMESH_RANK_PCP=${r[1]} KVMESH_RANK_DCP=${r[2]} KVMESH_RANK_PP=${r[3]}"
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
    $(auth_env) \
    $(service_env "$name") \
    nohup "$root/bin/$(binary "$name")" >"$dev/logs/$name.log" 2>&1 &
  echo $! >"$dev/pids/$name"
}

# readyz PORT prints the HTTP status of GET /readyz on 127.0.0.1:PORT (000
# when nothing answers), with bash's /dev/tcp so that curl is not needed.
readyz() {
  local code=000
  if { exec 3<>"/dev/tcp/127.0.0.1/$1"; } 2>/dev/null; then
    printf 'GET /readyz HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n' >&3
    read -r _ code _ <&3 || code=000
    exec 3<&-
  fi
  echo "${code:-000}"
}

ready() { [ "$(readyz "$1")" = 200 ]; }

# auth_env prints the services' authentication settings: required, with
# the stack's auth key file (made once by up), unless KVMESH_AUTH=off was
# given.
auth_env() {
  if [ "${KVMESH_AUTH:-required}" = off ]; then
    echo "KVMESH_AUTH=off"
  else
    echo "KVMESH_AUTH=required KVMESH_AUTH_KEY_FILE=$dev/auth.key"
  fi
}

up() {
  [ -f "$dev/env" ] || die "run scripts/devstack.sh up first (make up does)"
  [ -f "$dev/admin-token" ] || head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$dev/admin-token"
  [ -f "$dev/auth.key" ] || (umask 077 && head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$dev/auth.key")
  broker_up
  echo "$engines" >"$dev/engines"
  echo "$KVMESH_MODEL" >"$dev/model"
  env | grep -E '^KVMESH_(TP|PCP|DCP|PP)=' >"$dev/parallel" || true
  local s
  for s in "${services[@]}"; do service_up "${s%%:*}" "${s##*:}"; done
  for s in "${services[@]}"; do
    wait_for "${s%%:*}" 60 ready "${s##*:}" ||
      die "${s%%:*} not ready on :${s##*:}; see $dev/logs/${s%%:*}.log"
  done
  say "all services ready (model $KVMESH_MODEL, $world rank(s) per engine, $engines engine pair(s): gpuworkers on :8084-:$((8084 + 2 * engines * world - 1)))"
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
  # What up recorded describes the stack that ran: the next up starts from
  # the environment and the defaults again.
  rm -f "$dev/engines" "$dev/model" "$dev/parallel"
}

status() {
  local s name port state
  printf '%-26s %-7s %-22s %s\n' SERVICE PID ADDRESS READY
  for s in broker:0 "${services[@]}"; do
    name=${s%%:*} port=${s##*:}
    pid=-
    running "$name" && pid=$(cat "$dev/pids/$name")
    if [ "$name" = broker ]; then
      state=$([ "$pid" != - ] && echo up || echo down)
      printf '%-26s %-7s %-22s %s\n' "$name" "$pid" "$(cat "$dev/broker.addr" 2>/dev/null || echo -)" "$state"
      continue
    fi
    state=$(readyz "$port")
    printf '%-26s %-7s %-22s %s\n' "$name" "$pid" "http://127.0.0.1:$port" "$state"
  done
}

# env prints what run.sh, demo.sh and traces.sh need to know of the stack.
env_exports() {
  local v
  printf 'export KVMESH_ENGINES=%q KVMESH_MODEL=%q KVMESH_WORLD=%q\n' "$engines" "$KVMESH_MODEL" "$world"
  # The credentials of the stack's clients (kvmesh sim and the admin
  # commands): its auth key file and operator token.
  local a
  for a in $(auth_env); do printf 'export %q\n' "$a"; done
  printf 'export KVMESH_ADMIN_TOKEN=%q\n' "${KVMESH_ADMIN_TOKEN:-$(cat "$dev/admin-token" 2>/dev/null)}"
  for v in KVMESH_TP KVMESH_PCP KVMESH_DCP KVMESH_PP; do
    if [ -n "${!v:-}" ]; then printf 'export %s=%q\n' "$v" "${!v}"; fi
  done
}

case "${1:-}" in
  up) up ;;
  env) env_exports ;;
  down) down ;;
  status) status ;;
  *) echo "usage: $0 up|down|status|env" >&2; exit 2 ;;
esac
