#!/usr/bin/env bash
# benchreport.sh BENCH_TXT REPORT — writes the headline figures of a
# `go test -bench` output to REPORT, one a line:
#   NAME VALUE UNIT baseline=RAW ratio=VALUE/RAW
# each with its baseline measured by the same benchmark in the same run on
# the same servers. It fails when a figure's benchmark line is missing, so a
# renamed benchmark cannot silently drop its line.
set -euo pipefail
in=${1:?usage: benchreport.sh BENCH_TXT REPORT}
out=${2:?usage: benchreport.sh BENCH_TXT REPORT}
trap 'rm -f "$out.tmp"' EXIT

# metric BENCH UNIT prints the value that precedes UNIT on the line of
# benchmark BENCH (its name up to the -GOMAXPROCS suffix).
metric() {
  awk -v b="$1" -v u="$2" '
    { name = $1; sub(/-[0-9]+$/, "", name) }
    name == b { for (i = 3; i < NF; i++) if ($(i+1) == u) { print $i; found = 1; exit } }
    END { if (!found) exit 1 }' "$in" || { echo "benchreport: no $2 for $1 in $in" >&2; exit 1; }
}

# figure NAME UNIT BENCH VALUE_UNIT BASE_BENCH BASE_UNIT writes one report
# line: BENCH's VALUE_UNIT against BASE_BENCH's BASE_UNIT.
figure() {
  local v r
  v=$(metric "$3" "$4")
  r=$(metric "$5" "$6")
  awk -v n="$1" -v v="$v" -v u="$2" -v r="$r" 'BEGIN { printf "%s %s %s baseline=%s ratio=%.3f\n", n, v, u, r, v / r }'
}

{
  # Save: a steady stream of tasks on kvmesh.save.tasks → bytes in Redis
  # through the sender and the gpuworker, against raw SET of the same values
  # at the same parallelism (MB/s).
  for size in 256KiB:256k 1MiB:1m 2MiB:2m; do
    b=BenchmarkSaveThroughput/${size%%:*}/sender
    figure "save_${size#*:}" MB/s "$b" MB/s "$b" raw_set_MB/s
  done
  # Load: load task → bytes in the pool, against raw GET at the same
  # parallelism (MiB/s).
  for size in 256KiB:256k 1MiB:1m 2MiB:2m; do
    b=BenchmarkLoad/${size%%:*}
    figure "load_${size#*:}" MiB/s "$b" load_MiB/s "$b" raw_MiB/s
  done
  # CPU per GiB moved (s/GiB), read from the kernel around each timed part:
  # a save — every process kvmesh uses to move the bytes (the test process
  # with the sender, the broker and the test's producer and consumer; the
  # gpuworker; the whole PostgreSQL server; Redis) — against raw SET of the
  # same values (the client process and Redis) in the same run.
  for size in 256KiB:256k 1MiB:1m; do
    b=BenchmarkSaveThroughput/${size%%:*}/sender
    figure "save_cpu_${size#*:}" s/GiB "$b" cpu_s/GiB "$b" raw_cpu_s/GiB
  done
  # A load — the test process with the gpuworker, the broker and the test's
  # producer and consumer; the whole PostgreSQL server; Redis — against raw
  # GET of the same values (the client process and Redis).
  for size in 256KiB:256k 1MiB:1m; do
    b=BenchmarkLoad/${size%%:*}
    figure "load_cpu_${size#*:}" s/GiB "$b" cpu_s/GiB "$b" raw_cpu_s/GiB
  done
  # The same on a Redis Cluster (3 masters + 3 replicas on loopback):
  # the store's Put and Get of 64 framed 1 MiB values spread over every
  # master, against a raw go-redis ClusterClient pipeline of SET NX / GET of
  # the same values at the same parallelism (MiB/s).
  figure cluster_save_1m MiB/s BenchmarkClusterPut MiB/s BenchmarkClusterPut raw_MiB/s
  figure cluster_load_1m MiB/s BenchmarkClusterGet MiB/s BenchmarkClusterGet raw_MiB/s
  # The object tier (a private versitygw and redis-server on loopback), 64
  # framed 1 MiB values a round, the median round (9 of a save, 31 of a
  # load) in turns with the baseline: a save — the write-behind: Tier.Put
  # in calls of 4 keys, 4 at once, over a hot store that keeps nothing (the
  # Redis put is save_1m's), then Drain until the writers stored every copy
  # in the bucket — and a load of values only the bucket holds —
  # Tier.GetEach in calls of 4 keys, 4 at once, each value checked
  # (DecodeValue) and promoted into Redis after the load — against the raw
  # minio-go client's PUT (single part, unsigned payload, as the tier
  # sends) and GET (GetObject into a kept buffer of the body's size, the
  # same DecodeValue check) of the same objects at the same concurrency
  # (MiB/s). Then the seed (TP1 shape) on the mesh with the
  # tier: its replay on fresh engines after a Redis FLUSHALL, hit rate from
  # the tier, against its replay with Redis intact (%).
  figure tier_save_1m MiB/s BenchmarkTierSave1M MiB/s BenchmarkTierSave1M raw_MiB/s
  figure tier_load_1m MiB/s BenchmarkTierLoad1M MiB/s BenchmarkTierLoad1M raw_MiB/s
  figure seed_after_flush % BenchmarkSeedAfterFlush after_flush_hit_% BenchmarkSeedAfterFlush intact_hit_%
  # Seed preset at --rate 0 (TP1 shape) through the full mesh: store bytes
  # the gpuworkers moved (save_put + load_get) per second of the run,
  # against raw SET of the same bytes in the model's block sizes (MB/s).
  figure seed_saturated MB/s BenchmarkSeedSaturated store_MB/s BenchmarkSeedSaturated raw_set_MB/s
  # CPU per request of the whole mesh (BenchmarkMeshCPU): the services,
  # PostgreSQL and the broker, read from /proc around the seed preset's
  # 300 requests at --rate 0 (TP1, and the seed's own TP8), against the
  # machine's CPU per pgbench single-row UPDATE transaction on the same
  # cluster (ms). The per-process split is on the benchmark's line in
  # bench.txt (<process>_ms/request) and in its log.
  figure mesh_cpu_per_request ms BenchmarkMeshCPU/tp1 ms/request BenchmarkMeshCPU/pgbench_update ms/tx
  figure mesh_cpu_per_request_tp8 ms BenchmarkMeshCPU/tp8 ms/request BenchmarkMeshCPU/pgbench_update ms/tx
  # Lookup of a 32K-token, 2-group prompt through POST /v1/lookup (decision
  # published), against one raw pipelined EXISTS of the same keys (p50, µs).
  figure lookup_32k_p50 us BenchmarkLookup32K2Group/handler_block_hashes_published p50-us \
    BenchmarkLookup32K2Group/exists_raw p50-us
  # Scheduler (BenchmarkScheduler, PostgreSQL with fsync on): request
  # updates one scheduler applies per second from synthetic engines' step
  # records with 2K and 32K prompts, against pgbench's single-row UPDATE
  # tps on the same cluster.
  for len in 2k 32k; do
    figure "scheduler_updates_$len" updates/s "BenchmarkScheduler/updates_$len" updates/s \
      BenchmarkScheduler/pgbench_update tps
  done
  # Engine-step record → save task p99 at half the 2K update rate, against
  # pgbench's UPDATE p99 at the same rate of transactions (ms).
  figure scheduler_p99_ms ms BenchmarkScheduler/p99 p99-ms BenchmarkScheduler/p99 pgbench_p99-ms
  # Engines (256 running requests, 30 steps/s) one scheduler keeps up with,
  # against the engines pgbench's tps carries at one UPDATE per request update.
  figure fleet_engines engines BenchmarkScheduler/fleet engines BenchmarkScheduler/fleet baseline_engines
  # Engines three scheduler replicas (one consumer group, one database,
  # three times the partitions) keep up with, against one replica's
  # engines (fleet's). All replicas share the benchmark machine's cores.
  figure fleet_engines_3_replicas engines BenchmarkScheduler/fleet_3_replicas engines \
    BenchmarkScheduler/fleet_3_replicas baseline_engines
} >"$out.tmp"
mv "$out.tmp" "$out"
cat "$out"
