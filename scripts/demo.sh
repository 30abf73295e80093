#!/usr/bin/env bash
# demo.sh — the `make run` workload: the engine simulator (kvmesh sim) plays
# the seed preset (2-group hybrid model, 1P1D with the pd,store connector
# chain, a small GPU pool) against the stack scripts/stack.sh started, prints
# its report, then the admin URLs. Extra arguments go to `kvmesh sim`
# (e.g. scripts/demo.sh --requests 50 --json). Exits with the simulator's
# status: non-zero when a request failed, a loaded block or a stored value
# mismatched, or the save ledger did not balance.
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

"$root/bin/kvmesh" sim --preset seed "$@"
status=$?

cat >&2 <<URLS

admin:
  scheduler  http://127.0.0.1:8082/v1/requests        (trackers; /v1/requests/{engine}/{request})
  sender     http://127.0.0.1:8083/v1/stats           (saves accounting)
             http://127.0.0.1:8083/v1/dlq             (dead letters)
  gpuworker  http://127.0.0.1:8084/v1/pool            (decode-0 pool; /v1/devices for GPUs)
             http://127.0.0.1:8085/v1/pool            (prefill-0 pool)
  lookup     http://127.0.0.1:8081/metrics            (every service serves /metrics, /healthz, /readyz, /openapi.yaml)
  CLI        bin/kvmesh status | dlq list | requests list | workers   (bin/kvmesh help)
URLS
exit $status
