#!/usr/bin/env bash
# run.sh — what `make run` does once `make up` has the stack running: the
# demo workload (scripts/demo.sh: kvmesh sim, seed preset) and its report,
# the stack's status and `kvmesh status` (readiness and key counters of
# every service, from /readyz and /metrics), then — on a terminal — it keeps the stack up until
# Ctrl-C and stops it. Without a terminal (CI, pipes) it returns at once and
# leaves the stack up for `make down`. Exits with the demo's status.
# KVMESH_ENGINES=N (default: what scripts/stack.sh up recorded, else 1)
# plays a fleet of N engine pairs (kvmesh sim --engines N); the stack must
# have been started with the same KVMESH_ENGINES.
#
# KVMESH_DEV_TIER=on (`make run TIER=on`, which first starts the dev S3
# server, scripts/s3server.sh up, and the stack with the capacity tier:
# scripts/stack.sh) replays the demo from the tier: the demo runs as above
# but unsalted on a workload seed of its own (kvmesh sim --fresh=false
# --seed S: S random, or KVMESH_DEV_TIER_SEED, so that the run starts cold
# and a second run can hash alike); then, once every gpuworker's
# write-behind queue is empty (kvmesh_tier_write_queue_bytes 0 on its
# /metrics; up to KVMESH_DEV_TIER_DRAIN_TIMEOUT seconds, default 300), it
# flushes the stack's Redis database (its own: Redis database
# KVMESH_DEV_TIER_REDIS_DB of the dev Redis, default 9), replays the same
# workload on fresh engines (a new run tag, the same seed; report in
# .dev/tier-replay.json, its log .dev/logs/tier-replay.log), and prints
# the prefix hit rate of both runs and the blocks each loaded from the
# tier. The exit status is then the first run's, else the replay's.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dev="$root/.dev"
# TIER=on asks for the replay; the stack's own mode comes from stack.sh env.
tier_run=${KVMESH_DEV_TIER:-off}
# The stack's engines, model, parallel overrides and world size, as
# scripts/stack.sh up recorded them (unless given now).
env=$("$root/scripts/stack.sh" env) || exit 1
eval "$env"
# Every gpuworker of the fleet: W ranks per engine, decode-i rank k at
# :8084+2iW+k, prefill-i at :8084+(2i+1)W+k.
workers=
for ((p = 0; p < 2 * KVMESH_ENGINES * KVMESH_WORLD; p++)); do
  workers+="${workers:+,}http://127.0.0.1:$((8084 + p))"
done

# hit_rate FILE prints the prefix hit rate (percent) of a sim report,
# JSON or text; "?" when it has none.
hit_rate() {
  local v
  v=$(grep -o '"prefix_hit_rate": *[0-9.eE+-]*' "$1" 2>/dev/null | head -n 1 | sed 's/.*: *//')
  if [ -n "$v" ]; then
    awk -v v="$v" 'BEGIN { printf "%.1f%%", 100 * v }'
    return
  fi
  v=$(sed -n 's/^prefix hit rate  *\([0-9.]*%\).*/\1/p' "$1" 2>/dev/null | head -n 1)
  echo "${v:-?}"
}

# tier_blocks FILE prints the blocks a sim report says it loaded from the
# tier (ledger.load_tier_blocks; the text report's "capacity tier" row,
# absent when 0).
tier_blocks() {
  local v
  v=$(grep -o '"load_tier_blocks": *[0-9]*' "$1" 2>/dev/null | head -n 1 | sed 's/.*: *//')
  if [ -z "$v" ] && grep -q '^prefix hit rate' "$1" 2>/dev/null; then
    v=$(sed -n 's/^capacity tier  *\([0-9][0-9]*\) of the loaded blocks.*/\1/p' "$1" | head -n 1)
    v=${v:-0}
  fi
  echo "${v:-?}"
}

# queue_bytes URL prints a gpuworker's kvmesh_tier_write_queue_bytes, empty
# when it does not answer or has no such gauge.
queue_bytes() {
  curl -sf --max-time 5 "$1/metrics" 2>/dev/null | awk '$1 == "kvmesh_tier_write_queue_bytes" { print $2 + 0; exit }'
}

# tier_drain waits until every gpuworker's write-behind queue is empty.
tier_drain() {
  local limit=${KVMESH_DEV_TIER_DRAIN_TIMEOUT:-300} start=$SECONDS u q busy next=$((SECONDS + 15))
  while :; do
    busy=
    for u in ${workers//,/ }; do
      q=$(queue_bytes "$u")
      if [ -z "$q" ]; then
        echo "run: $u/metrics has no kvmesh_tier_write_queue_bytes: is the stack running with the tier (make down, then make run TIER=on)?" >&2
        return 1
      fi
      [ "$q" = 0 ] || busy+=" $u:${q}B"
    done
    [ -n "$busy" ] || break
    if [ $((SECONDS - start)) -ge "$limit" ]; then
      echo "run: the write-behind queues are not empty after ${limit}s:$busy" >&2
      return 1
    fi
    if [ $SECONDS -ge $next ]; then
      echo "run: waiting for the write-behind queues:$busy" >&2
      next=$((SECONDS + 15))
    fi
    sleep 0.5
  done
  echo "run: every gpuworker's write-behind queue is empty ($((SECONDS - start))s)" >&2
}

# tier_replay FIRST ARGS... flushes the stack's Redis database once the
# write-behind queues are empty, replays the first run's workload (its
# report in FIRST) from the tier, and compares the two runs.
tier_replay() {
  local first=$1 replay="$dev/tier-replay.json" log="$dev/logs/tier-replay.log" keys rc=0
  shift
  command -v curl >/dev/null || { echo "run: TIER=on needs curl" >&2; return 1; }
  command -v redis-cli >/dev/null || { echo "run: TIER=on needs redis-cli (Debian: redis-tools)" >&2; return 1; }
  # .dev/tier: scripts/stack.sh up started the stack with the tier (and
  # its env exported the tier database's KVMESH_REDIS_URL).
  if [ ! -f "$dev/tier" ] || [ -z "${KVMESH_REDIS_URL:-}" ]; then
    echo "run: the stack is not running with the capacity tier (make down, then make run TIER=on)" >&2
    return 1
  fi
  echo >&2
  tier_drain || return 1
  # The stack's own database: nothing else of the dev Redis is touched.
  if ! keys=$(redis-cli -u "$KVMESH_REDIS_URL" DBSIZE) || ! redis-cli -u "$KVMESH_REDIS_URL" FLUSHDB >/dev/null; then
    echo "run: cannot flush Redis database ${KVMESH_REDIS_URL##*/}" >&2
    return 1
  fi
  echo "run: flushed the stack's Redis database ${KVMESH_REDIS_URL##*/} ($keys keys); replaying the workload (seed $tier_seed) on fresh engines from the tier (log: .dev/logs/tier-replay.log)" >&2
  "$root/scripts/demo.sh" "${tier_args[@]}" "$@" --json >"$replay" 2>"$log" || rc=$?
  if [ "$rc" != 0 ]; then
    tail -n 20 "$log" >&2
    echo "run: the replay failed (exit $rc); its report: .dev/tier-replay.json" >&2
  fi
  {
    echo
    echo "capacity tier: the workload (seed $tier_seed, unsalted) before and after flushing Redis"
    printf '  %-30s %-17s %s\n' "" "prefix hit rate" "blocks loaded from the tier"
    printf '  %-30s %-17s %s\n' "first run (cold)" "$(hit_rate "$first")" "$(tier_blocks "$first")"
    printf '  %-30s %-17s %s\n' "replay after the flush" "$(hit_rate "$replay")" "$(tier_blocks "$replay")"
    echo "  (the replay's report: .dev/tier-replay.json)"
  } >&2
  return "$rc"
}

if [ "$tier_run" = on ]; then
  # Unsalted, on a workload seed of its own: cold now, and the replay's
  # blocks hash alike.
  tier_seed=${KVMESH_DEV_TIER_SEED:-$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')}
  tier_args=(--fresh=false --seed "$tier_seed")
  mkdir -p "$dev/logs"
  "$root/scripts/demo.sh" "${tier_args[@]}" "$@" | tee "$dev/tier-run.txt"
  status=${PIPESTATUS[0]}
  if [ "$status" = 0 ]; then
    tier_replay "$dev/tier-run.txt" "$@" || status=1
  else
    echo "run: the first run failed: no replay from the tier" >&2
  fi
else
  "$root/scripts/demo.sh" "$@"
  status=$?
fi
echo >&2
"$root/scripts/stack.sh" status >&2
echo >&2
# Every service's readiness and key counters, read from /readyz and /metrics.
"$root/bin/kvmesh" status --gpuworker-url "$workers" >&2
if [ -t 0 ] && [ -t 1 ]; then
  echo >&2
  echo "The stack stays up: press Ctrl-C to stop it (or run 'make down' from another terminal)." >&2
  trap 'echo >&2; "$root/scripts/stack.sh" down; "$root/scripts/devstack.sh" down; exit $status' INT TERM
  while :; do sleep 3600 & wait $!; done
fi
echo "The stack is still up; 'make down' stops it." >&2
exit $status
