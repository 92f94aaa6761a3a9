#!/usr/bin/env bash
# Ensure a throwaway PostgreSQL server runs on loopback for tests/test_store.py, and say how to reach it.
#
#   eval "$(bash tests/postgres.sh)"            # prints: export NORMTUNE_TEST_POSTGRES_URL=postgresql://...
#   bash tests/postgres.sh pg.env && . pg.env   # writes that line to pg.env instead
#   bash tests/postgres.sh --stop               # stops the server (the cluster directory is kept)
#
# Idempotent: a server already started by this script is reused. Quiet: prints only the export line, or the
# server's log on failure. Installs Debian's `postgresql` package when no server binaries are found (CI machines
# start bare). As root, the cluster belongs to the `postgres` user (PostgreSQL refuses to run as root).
# fsync is off: the server holds nothing but test databases.
#
# Settings (environment): NORMTUNE_PG_DIR (cluster directory, default /tmp/normtune-pg-<user>),
# NORMTUNE_PG_PORT (first port tried, default 55432).
set -euo pipefail

DIR="${NORMTUNE_PG_DIR:-/tmp/normtune-pg-$(id -un)}"
PORT="${NORMTUNE_PG_PORT:-55432}"
ROLE=normtune PASSWORD=normtune DB=normtune
LOG="$DIR.log"
ENV_FILE=""
if [ -n "${1:-}" ] && [ "$1" != "--stop" ]; then ENV_FILE=$(realpath -m "$1"); fi
cd /  # the server's user may not be able to read the caller's directory

fail() {
    echo "tests/postgres.sh: $*" >&2
    [ -f "$LOG" ] && tail -n 30 "$LOG" >&2
    [ -f "$DIR/server.log" ] && tail -n 30 "$DIR/server.log" >&2
    exit 1
}

has_tools() { for tool in pg_ctl initdb psql pg_isready; do [ -x "$1/$tool" ] || return 1; done; }
find_bin() {
    local bin
    bin=$(command -v pg_ctl 2>/dev/null || true)
    [ -n "$bin" ] && bin=$(dirname "$(readlink -f "$bin")")
    if [ -n "$bin" ] && has_tools "$bin"; then echo "$bin"; return; fi
    # Debian keeps the server binaries off PATH, one directory per major version: take the newest.
    for bin in $(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -t/ -k5 -n -r); do
        if has_tools "$bin"; then echo "$bin"; return; fi
    done
}

BIN=$(find_bin)
if [ "${1:-}" = "--stop" ] && [ -z "$BIN" ]; then exit 0; fi  # nothing installed, nothing running
if [ -z "$BIN" ]; then
    [ "$(id -u)" = 0 ] || fail "no PostgreSQL binaries (pg_ctl, initdb, psql, pg_isready), and only root may" \
        "install them: apt-get install postgresql"
    : >"$LOG"
    { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends postgresql; } \
        >>"$LOG" 2>&1 || fail "apt-get install postgresql failed"
    BIN=$(find_bin)
    [ -n "$BIN" ] || fail "installed postgresql but found no pg_ctl/initdb/psql/pg_isready under /usr/lib/postgresql"
fi

# Run the server's tools as a non-root user.
if [ "$(id -u)" = 0 ]; then
    id postgres >/dev/null 2>&1 ||
        useradd --system --user-group --home-dir /nonexistent --shell /usr/sbin/nologin postgres >>"$LOG" 2>&1 ||
        fail "cannot create the postgres user"
    as_owner() { runuser -u postgres -- "$@"; }
    OWNER=postgres
else
    as_owner() { "$@"; }
    OWNER=$(id -un)
fi
psql_admin() {  # over the Unix socket in the cluster directory, as the cluster's superuser (peer auth)
    as_owner "$BIN/psql" -h "$DIR" -p "$PORT" -U "$OWNER" -d postgres -X -q -t -A -v ON_ERROR_STOP=1 "$@"
}
port_in_use() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

if [ "${1:-}" = "--stop" ]; then
    [ -f "$DIR/postmaster.pid" ] && as_owner "$BIN/pg_ctl" -D "$DIR" -m fast -w stop >/dev/null 2>&1 || true
    exit 0
fi

if [ ! -f "$DIR/PG_VERSION" ]; then
    rm -rf "$DIR"
    install -d -m 700 -o "$OWNER" "$DIR"
    as_owner "$BIN/initdb" -D "$DIR" -U "$OWNER" -E UTF8 --no-locale --auth-local=peer \
        --auth-host=scram-sha-256 >"$LOG" 2>&1 || fail "initdb failed"
fi

if as_owner "$BIN/pg_ctl" -D "$DIR" status >/dev/null 2>&1; then
    PORT=$(sed -n 4p "$DIR/postmaster.pid")  # the running server's port
else
    while port_in_use "$PORT"; do PORT=$((PORT + 1)); done
    as_owner "$BIN/pg_ctl" -D "$DIR" -l "$DIR/server.log" -w -t 60 start -o "-p $PORT -k $DIR \
        -c listen_addresses=127.0.0.1 -c fsync=off -c synchronous_commit=off -c full_page_writes=off \
        -c max_connections=200 -c autovacuum=off" >>"$LOG" 2>&1 || fail "the server did not start"
fi
for _ in $(seq 60); do
    "$BIN/pg_isready" -q -h 127.0.0.1 -p "$PORT" && break
    sleep 0.5
done
"$BIN/pg_isready" -q -h 127.0.0.1 -p "$PORT" || fail "the server does not accept connections on 127.0.0.1:$PORT"

# The test role may create databases: the suite makes a fresh one per test.
psql_admin -c "DO \$\$ BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '$ROLE') THEN
        CREATE ROLE $ROLE LOGIN CREATEDB PASSWORD '$PASSWORD';
    END IF; END \$\$;" >>"$LOG" 2>&1 || fail "cannot create role $ROLE"
if [ -z "$(psql_admin -c "SELECT 1 FROM pg_database WHERE datname = '$DB'" 2>>"$LOG")" ]; then
    psql_admin -c "CREATE DATABASE $DB OWNER $ROLE" >>"$LOG" 2>&1 || fail "cannot create database $DB"
fi

LINE="export NORMTUNE_TEST_POSTGRES_URL=postgresql://$ROLE:$PASSWORD@127.0.0.1:$PORT/$DB"
if [ -n "$ENV_FILE" ]; then echo "$LINE" >"$ENV_FILE"; else echo "$LINE"; fi
