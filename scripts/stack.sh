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
#
# KVMESH_DEV_TIER=on (`make run TIER=on`; default: what `up` recorded in
# .dev/tier, else off) runs the stack with the capacity tier below Redis:
# the dev S3 server of scripts/s3server.sh (which must be up: its
# KVMESH_DEV_TIER_URL, _ACCESS_KEY and _SECRET_KEY in .dev/env) becomes the
# KVMESH_TIER_URL, _ACCESS_KEY and _SECRET_KEY of the lookup and every
# gpuworker (the programs that read them), and every process uses Redis
# database KVMESH_DEV_TIER_REDIS_DB (default 9) of the dev Redis instead of
# .dev/env's, a database of the tier stack alone: the dev Redis is shared
# with the tests, and scripts/run.sh flushes that database to replay the
# workload from the tier. `env` then exports that Redis URL, for the
# simulator's check of the stored values. `up` refuses to change the mode
# of a running stack: `make down` first.
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
# The capacity tier (KVMESH_DEV_TIER, on or off): given, else what `up`
# recorded (.dev/tier holds the Redis database of a tier stack), else off.
recorded_tier=off
[ -f "$dev/tier" ] && recorded_tier=on
tier=${KVMESH_DEV_TIER:-$recorded_tier}
case $tier in
  on | off) ;;
  *) die "KVMESH_DEV_TIER=$tier: want on or off" ;;
esac
# The Redis database of a tier stack: the recorded one, else
# KVMESH_DEV_TIER_REDIS_DB, else 9.
tier_db=$(cat "$dev/tier" 2>/dev/null || true)
tier_db=${tier_db:-${KVMESH_DEV_TIER_REDIS_DB:-9}}
[[ $tier_db =~ ^[0-9]+$ ]] || die "KVMESH_DEV_TIER_REDIS_DB=$tier_db: want a Redis database number"

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
# latter two for engine pair 0): a gpuworker's engine id and rank; with the
# tier on, the lookup's and every gpuworker's tier settings (tier_env).
service_env() {
  local name=$1 rank=0 pair=0 engine
  case $name in
    lookup) echo "KVMESH_LOOKUP_CONNECTORS=${KVMESH_LOOKUP_CONNECTORS:-pd,store} $(tier_env)"; return ;;
    gpuworker*) tier_env ;;
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

# tier_env prints the tier settings of the programs that read them (the
# lookup and the gpuworkers): the dev S3 server's URL and root credentials
# from .dev/env (scripts/s3server.sh up); nothing with the tier off.
tier_env() {
  [ "$tier" = on ] || return 0
  echo "KVMESH_TIER_URL=$KVMESH_DEV_TIER_URL KVMESH_TIER_ACCESS_KEY=$KVMESH_DEV_TIER_ACCESS_KEY KVMESH_TIER_SECRET_KEY=$KVMESH_DEV_TIER_SECRET_KEY"
}

# redis_url prints the Redis URL every process uses: .dev/env's, on
# database tier_db with the tier on.
redis_url() {
  local url
  # shellcheck disable=SC1091
  url=$(source "$dev/env" && echo "${KVMESH_REDIS_URL:-}")
  [ -n "$url" ] || die "no KVMESH_REDIS_URL in $dev/env (scripts/devstack.sh up writes it)"
  if [ "$tier" = on ]; then
    [[ $url =~ ^(rediss?://[^/?]+)(/[0-9]*)?(\?.*)?$ ]] ||
      die "cannot put Redis database $tier_db into $url"
    url="${BASH_REMATCH[1]}/$tier_db${BASH_REMATCH[3]}"
  fi
  echo "$url"
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
  KVMESH_REDIS_URL=$(redis_url)
  # shellcheck disable=SC2046
  env KVMESH_HTTP_ADDR="127.0.0.1:$port" \
    KVMESH_REDIS_URL="$KVMESH_REDIS_URL" \
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
  tier_up
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
  if [ "$tier" = on ]; then
    # shellcheck disable=SC1091
    say "capacity tier on: $(source "$dev/env" && echo "$KVMESH_DEV_TIER_URL") (lookup, gpuworkers); Redis database $tier_db"
  fi
}

# tier_up checks the tier mode against a running stack's and records it:
# a running stack keeps the mode it was started with, so asking for the
# other one is an error rather than a stack half of each.
tier_up() {
  local s any=
  for s in broker "${services[@]}"; do
    if running "${s%%:*}"; then any=${s%%:*}; break; fi
  done
  if [ -n "$any" ] && [ "$tier" != "$recorded_tier" ]; then
    die "the stack is running with the capacity tier $recorded_tier ($any is up); KVMESH_DEV_TIER=$tier needs a fresh one: make down (or scripts/stack.sh down) first"
  fi
  # A record of a stack no longer running (stopped without down) is no
  # default: a fresh stack runs without the tier unless asked.
  if [ -z "$any" ]; then
    [ -n "${KVMESH_DEV_TIER:-}" ] || tier=off
    tier_db=${KVMESH_DEV_TIER_REDIS_DB:-9}
    [[ $tier_db =~ ^[0-9]+$ ]] || die "KVMESH_DEV_TIER_REDIS_DB=$tier_db: want a Redis database number"
  fi
  if [ "$tier" = on ]; then
    # shellcheck disable=SC1091
    (source "$dev/env" && [ -n "${KVMESH_DEV_TIER_URL:-}" ] && [ -n "${KVMESH_DEV_TIER_ACCESS_KEY:-}" ]) ||
      die "KVMESH_DEV_TIER=on: no dev S3 server in $dev/env: run scripts/s3server.sh up first (make run TIER=on does)"
    echo "$tier_db" >"$dev/tier"
  else
    rm -f "$dev/tier"
  fi
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
  rm -f "$dev/engines" "$dev/model" "$dev/parallel" "$dev/tier"
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
  if [ "$tier" = on ]; then
    # shellcheck disable=SC1091
    printf 'capacity tier on: %s (lookup, gpuworkers); Redis database %s\n' "$(source "$dev/env" && echo "${KVMESH_DEV_TIER_URL:-?}")" "$tier_db"
  fi
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
  # A tier stack's mode and store: its Redis database, for the simulator's
  # check of the stored values (scripts/demo.sh) and scripts/run.sh.
  if [ "$tier" = on ]; then
    printf 'export KVMESH_DEV_TIER=on KVMESH_REDIS_URL=%q\n' "$(redis_url)"
  fi
}

case "${1:-}" in
  up) up ;;
  env) env_exports ;;
  down) down ;;
  status) status ;;
  *) echo "usage: $0 up|down|status|env" >&2; exit 2 ;;
esac
