#!/usr/bin/env bash
# demo.sh — the `make run` workload: the engine simulator (kvmesh sim) plays
# the seed preset (2-group hybrid model, 1P1D with the pd,store connector
# chain, a small GPU pool) against the stack scripts/stack.sh started, prints
# its report, then the admin URLs. Extra arguments go to `kvmesh sim`
# (e.g. scripts/demo.sh --requests 50 --json). Exits with the simulator's
# status: non-zero when a request failed, a loaded block or a stored value
# mismatched, or the save ledger did not balance. KVMESH_ENGINES=N (default:
# what scripts/stack.sh up recorded, else 1) plays a fleet of N engine pairs
# (kvmesh sim --engines N, against stack.sh's gpuworkers of N pairs).
set -uo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

# The store pool's URL (devstack's .dev/env), so that the simulator reads
# back and checks every value the run's saves stored.
if [ -z "${KVMESH_REDIS_URL:-}" ] && [ -f "$root/.dev/env" ]; then
  # shellcheck disable=SC1091
  KVMESH_REDIS_URL=$(source "$root/.dev/env" && echo "${KVMESH_REDIS_URL:-}")
  export KVMESH_REDIS_URL
fi

# The stack's engines, model, parallel overrides and its ranks per engine
# (each engine's gpuworkers are W consecutive ports), as scripts/stack.sh
# up recorded them unless given now.
env=$("$root/scripts/stack.sh" env) || exit 1
eval "$env"
engines=$KVMESH_ENGINES world=$KVMESH_WORLD
"$root/bin/kvmesh" sim --preset seed --model "$KVMESH_MODEL" ${KVMESH_TP:+--tp "$KVMESH_TP"} --engines "$engines" "$@"
status=$?

# The gpuworkers of engine pairs past the first (rank 0 of decode-i at
# :8084+2iW, of prefill-i at :8084+(2i+1)W; rank k k ports further).
ranks=
if [ "$world" -gt 1 ]; then ranks=", rank 0; ranks 1-$((world - 1)) on the next ports"; fi
more=
for ((i = 1; i < engines; i++)); do
  more+=$(printf '\n             http://127.0.0.1:%d/v1/pool            (decode-%d pool%s)' $((8084 + 2 * i * world)) "$i" "$ranks")
  more+=$(printf '\n             http://127.0.0.1:%d/v1/pool            (prefill-%d pool%s)' $((8084 + (2 * i + 1) * world)) "$i" "$ranks")
done

cat >&2 <<URLS

admin:
  scheduler  http://127.0.0.1:8082/v1/requests        (trackers; /v1/requests/{engine}/{request})
  sender     http://127.0.0.1:8083/v1/stats           (saves accounting)
             http://127.0.0.1:8083/v1/dlq             (dead letters)
  gpuworker  http://127.0.0.1:8084/v1/pool            (decode-0 pool${ranks}; /v1/devices for GPUs)
             http://127.0.0.1:$((8084 + world))/v1/pool            (prefill-0 pool${ranks})${more}
  lookup     http://127.0.0.1:8081/metrics            (every service serves /metrics, /healthz, /readyz, /openapi.yaml)
  CLI        bin/kvmesh status | dlq list | requests list | workers   (bin/kvmesh help)
URLS
exit $status
