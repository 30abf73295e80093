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
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
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

"$root/scripts/demo.sh" "$@"
status=$?
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
