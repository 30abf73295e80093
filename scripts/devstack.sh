#!/usr/bin/env bash
# devstack.sh — the local PostgreSQL and Redis that `make run`, `make up` and
# `make test` use, and the Prometheus binary that `make test` runs (the e2e
# test starts a private one of its own; this script never starts it).
#
#   scripts/devstack.sh up      start (or reuse) them; writes .dev/env
#   scripts/devstack.sh down    stop what this script started
#   scripts/devstack.sh status  say what is running
#
# KVMESH_DATABASE_URL / KVMESH_REDIS_URL are used as they are when set and
# reachable. Otherwise private instances are started under .dev/ on free
# loopback ports, installing the Debian packages postgresql, redis-server and
# prometheus with apt-get when they are missing and this runs as root.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
dev="$root/.dev"
mkdir -p "$dev"

say() { printf 'devstack: %s\n' "$*" >&2; }
die() { say "error: $*"; exit 1; }

# free_port START prints the first port at or above START that nothing listens on.
free_port() {
  local p=$1
  while (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; do p=$((p + 1)); done
  echo "$p"
}

apt_install() {
  if [ "$(id -u)" != 0 ]; then
    die "${*: -1} is not installed; install it with: sudo apt-get install -y $*"
  fi
  say "installing $* with apt-get"
  if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >"$dev/apt.log" 2>&1; then
    apt-get update -qq >>"$dev/apt.log" 2>&1 || true
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >>"$dev/apt.log" 2>&1 ||
      die "apt-get install $* failed; see $dev/apt.log"
  fi
}

pg_bin() {
  local d
  d=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1 || true)
  if [ -z "$d" ] || [ ! -x "$d/initdb" ]; then
    apt_install postgresql
    d=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)
  fi
  echo "$d"
}

# as_pg runs a command as the postgres user when we are root (initdb refuses root).
as_pg() {
  if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

# pg_home is where the private cluster lives: .dev/pg, or — when running as
# root in a checkout the postgres user cannot reach (e.g. under /root) — a
# per-checkout folder under /var/tmp.
pg_home() {
  if [ "$(id -u)" != 0 ] || runuser -u postgres -- test -x "$dev" 2>/dev/null; then
    echo "$dev/pg"
  else
    echo "/var/tmp/kvmesh-pg-$(printf %s "$root" | md5sum | cut -c1-12)"
  fi
}

# pg_durability DATA: the private dev cluster is disposable, so by default it
# trades crash safety of the *machine* for speed (tests create a database
# each). Process crashes (what kvmesh's own tests inject) lose nothing either
# way. KVMESH_DEV_PG_FSYNC=on restores the PostgreSQL defaults. The settings
# go in DATA/kvmesh-durability.conf, which postgresql.conf includes, rather
# than on the command line (which no configuration file can override): fsync
# and full_page_writes are reload-time settings, so `make bench` turns them on
# for its PostgreSQL benchmarks with ALTER SYSTEM (postgresql.auto.conf,
# read after the include) and resets them afterwards, without a restart.
pg_durability() {
  local data=$1 conf=$1/kvmesh-durability.conf
  {
    echo "# Written by scripts/devstack.sh at each start of the dev cluster."
    if [ "${KVMESH_DEV_PG_FSYNC:-off}" != on ]; then
      echo "fsync = off"
      echo "full_page_writes = off"
    fi
  } >"$conf"
  grep -q "^include_if_exists = 'kvmesh-durability.conf'" "$data/postgresql.conf" ||
    echo "include_if_exists = 'kvmesh-durability.conf'" >>"$data/postgresql.conf"
  if [ "$(id -u)" = 0 ]; then chown postgres:postgres "$conf" "$data/postgresql.conf"; fi
}

# pg_start BIN DATA HOME PORT starts the cluster.
pg_start() {
  pg_durability "$2"
  as_pg "$1/pg_ctl" -D "$2" -l "$3/postgres.log" -w -t 30 start \
    -o "-p $4 -k $3/run -c listen_addresses=127.0.0.1 -c max_connections=400" >/dev/null ||
    die "postgres did not start; see $3/postgres.log"
}

# pg_fsync_check URL BIN DATA HOME PORT makes sure the running cluster's fsync
# can be changed with ALTER SYSTEM: a cluster an older devstack.sh started with fsync on its
# command line is restarted (once) the way pg_start starts it. It warns when
# an ALTER SYSTEM override of fsync is in place (a benchmark that was killed
# before it could reset it): the tests would run at fsync-on speed.
pg_fsync_check() {
  local url=$1 bin=$2 data=$3 home=$4 port=$5 src file
  IFS='|' read -r src file < <(psql "$url" -Atqc "select source, coalesce(sourcefile, '') from pg_settings where name = 'fsync'")
  if [ "$src" = "command line" ]; then
    say "postgres: restarting it so that fsync is set in a configuration file (reloadable) instead of the command line"
    as_pg "$bin/pg_ctl" -D "$data" -m fast -w stop >/dev/null || die "postgres did not stop"
    pg_start "$bin" "$data" "$home" "$port"
  elif [ "${file##*/}" = postgresql.auto.conf ]; then
    say "warning: fsync is overridden with ALTER SYSTEM (an interrupted make bench?); undo it with:"
    say "  psql \"$url\" -c 'ALTER SYSTEM RESET fsync' -c 'ALTER SYSTEM RESET full_page_writes' -c 'SELECT pg_reload_conf()'"
  fi
}

pg_url_ok() { command -v psql >/dev/null && psql "$1" -Atqc 'select 1' >/dev/null 2>&1; }

pg_up() {
  # The URL of the private cluster itself (a shell that sourced .dev/env)
  # takes the private cluster's path below, which checks its settings.
  if [ -n "${KVMESH_DATABASE_URL:-}" ] && [ "$KVMESH_DATABASE_URL" != "$(cat "$dev/pg.url" 2>/dev/null)" ] &&
    pg_url_ok "$KVMESH_DATABASE_URL"; then
    say "postgres: using KVMESH_DATABASE_URL"
    echo "$KVMESH_DATABASE_URL" >"$dev/pg.url"
    return
  fi
  local bin data port url home
  bin=$(pg_bin)
  home=$(pg_home)
  data="$home/data"
  mkdir -p "$home"
  echo "$home" >"$dev/pg.home"
  if [ -f "$home/port" ]; then
    port=$(cat "$home/port")
    url="postgres://kvmesh@127.0.0.1:$port/kvmesh?sslmode=disable"
    if "$bin/pg_isready" -q -h 127.0.0.1 -p "$port"; then
      say "postgres: already running on 127.0.0.1:$port"
      pg_fsync_check "$url" "$bin" "$data" "$home" "$port"
      echo "$url" >"$dev/pg.url"
      return
    fi
  fi
  mkdir -p "$home/run"
  if [ ! -f "$data/PG_VERSION" ]; then
    rm -rf "$data"
    mkdir -p "$data"
    if [ "$(id -u)" = 0 ]; then chown -R postgres:postgres "$home"; fi
    as_pg "$bin/initdb" -D "$data" -U kvmesh --auth=trust -E UTF8 --no-locale >"$home/initdb.log" 2>&1 ||
      die "initdb failed; see $home/initdb.log"
  fi
  if [ "$(id -u)" = 0 ]; then chown -R postgres:postgres "$home"; fi
  port=$(free_port "${KVMESH_DEV_PG_PORT:-15432}")
  echo "$port" >"$home/port"
  pg_start "$bin" "$data" "$home" "$port"
  url="postgres://kvmesh@127.0.0.1:$port/kvmesh?sslmode=disable"
  pg_fsync_check "postgres://kvmesh@127.0.0.1:$port/postgres?sslmode=disable" "$bin" "$data" "$home" "$port"
  psql "postgres://kvmesh@127.0.0.1:$port/postgres?sslmode=disable" -Atqc \
    "select 1 from pg_database where datname='kvmesh'" | grep -q 1 ||
    psql "postgres://kvmesh@127.0.0.1:$port/postgres?sslmode=disable" -qc 'create database kvmesh' >/dev/null
  echo "$url" >"$dev/pg.url"
  say "postgres: started on 127.0.0.1:$port (data $data)"
}

redis_url_ok() { command -v redis-cli >/dev/null && redis-cli -u "$1" ping 2>/dev/null | grep -q PONG; }

redis_up() {
  if [ -n "${KVMESH_REDIS_URL:-}" ] && redis_url_ok "$KVMESH_REDIS_URL"; then
    say "redis: using KVMESH_REDIS_URL"
    echo "$KVMESH_REDIS_URL" >"$dev/redis.url"
    return
  fi
  command -v redis-server >/dev/null || apt_install redis-server
  mkdir -p "$dev/redis"
  local port
  if [ -f "$dev/redis/port" ]; then
    port=$(cat "$dev/redis/port")
    if redis_url_ok "redis://127.0.0.1:$port/0"; then
      say "redis: already running on 127.0.0.1:$port"
      echo "redis://127.0.0.1:$port/0" >"$dev/redis.url"
      return
    fi
  fi
  port=$(free_port "${KVMESH_DEV_REDIS_PORT:-16379}")
  echo "$port" >"$dev/redis/port"
  redis-server --bind 127.0.0.1 --port "$port" --save "" --appendonly no \
    --maxmemory "${KVMESH_DEV_REDIS_MAXMEMORY:-1gb}" --maxmemory-policy allkeys-lru --notify-keyspace-events Egxe \
    --dir "$dev/redis" --pidfile "$dev/redis/redis.pid" --logfile "$dev/redis/redis.log" \
    --daemonize yes >/dev/null
  for _ in $(seq 1 100); do
    redis_url_ok "redis://127.0.0.1:$port/0" && break
    sleep 0.1
  done
  redis_url_ok "redis://127.0.0.1:$port/0" || die "redis did not start; see $dev/redis/redis.log"
  echo "redis://127.0.0.1:$port/0" >"$dev/redis.url"
  say "redis: started on 127.0.0.1:$port"
}

# prometheus_install installs Debian's prometheus (without its recommended
# node exporter) when the binary is missing. Nothing here starts it: the
# package's own service is kept from starting on install (a policy-rc.d that
# refuses, unless one is in place already), and the tests that need
# Prometheus start a private one on a free port (internal/testenv/prometheus.go).
prometheus_install() {
  command -v prometheus >/dev/null && return
  if [ "$(id -u)" != 0 ]; then
    # Only the Prometheus e2e test needs it (skipped without it, failed
    # under `make test`); `make up` and `make run` do not.
    say "warning: prometheus is not installed; install it with: sudo apt-get install -y --no-install-recommends prometheus"
    return
  fi
  local policy=/usr/sbin/policy-rc.d made=""
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\n# devstack.sh: no service starts while it installs packages\nexit 101\n' >"$policy"
    chmod 755 "$policy"
    made=1
  fi
  local rc=0
  (apt_install --no-install-recommends prometheus) || rc=$?
  if [ -n "$made" ]; then rm -f "$policy"; fi
  [ "$rc" = 0 ] || exit "$rc"
  # Under systemd the package still enables its unit for the next boot.
  if [ -d /run/systemd/system ]; then systemctl disable --now prometheus >/dev/null 2>&1 || true; fi
  command -v prometheus >/dev/null || die "prometheus is not on PATH after installing it"
  say "prometheus: installed $(prometheus --version 2>&1 | head -n 1)"
}

# write_env writes its two lines and keeps the lines other scripts put in
# .dev/env (scripts/s3server.sh up: KVMESH_DEV_TIER_*).
write_env() {
  local keep=""
  if [ -f "$dev/env" ]; then
    keep=$(grep -v -e '^export KVMESH_DATABASE_URL=' -e '^export KVMESH_REDIS_URL=' "$dev/env" || true)
  fi
  {
    echo "export KVMESH_DATABASE_URL='$(cat "$dev/pg.url")'"
    echo "export KVMESH_REDIS_URL='$(cat "$dev/redis.url")'"
    if [ -n "$keep" ]; then echo "$keep"; fi
  } >"$dev/env"
}

down() {
  local bin home
  home=$(cat "$dev/pg.home" 2>/dev/null || echo "$dev/pg")
  if [ -f "$home/data/postmaster.pid" ]; then
    bin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)
    as_pg "$bin/pg_ctl" -D "$home/data" -m fast -w stop >/dev/null 2>&1 && say "postgres: stopped" || true
  fi
  if [ -f "$dev/redis/redis.pid" ]; then
    kill "$(cat "$dev/redis/redis.pid")" 2>/dev/null && say "redis: stopped" || true
    rm -f "$dev/redis/redis.pid"
  fi
  rm -f "$dev/env" "$dev/pg.url" "$dev/redis.url" "$dev/pg.home"
}

status() {
  [ -f "$dev/env" ] && cat "$dev/env" || say "not up"
}

case "${1:-}" in
  up) pg_up; redis_up; prometheus_install; write_env; cat "$dev/env" ;;
  down) down ;;
  status) status ;;
  *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
