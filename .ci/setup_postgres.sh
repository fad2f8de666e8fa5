#!/usr/bin/env bash
# Install PostgreSQL from Debian's packages, start one cluster (no systemd) and create the market's
# test role and database. Idempotent: running it again on a machine where all this is done changes
# nothing but makes sure the server is up. Run as root. It appends the URL the tests read to .ci/env:
#   export RUNYARD_TEST_PG_URL=postgresql+psycopg://runyard:runyard@127.0.0.1:5432/runyard_test
set -euo pipefail
cd "$(dirname "$0")/.."

PG_ROLE="${RUNYARD_PG_ROLE:-runyard}"
PG_PASSWORD="${RUNYARD_PG_PASSWORD:-runyard}"
PG_DB="${RUNYARD_PG_DB:-runyard_test}"
PG_PORT="${RUNYARD_PG_PORT:-5432}"

if ! command -v pg_ctlcluster >/dev/null 2>&1 || [ -z "$(ls /usr/lib/postgresql 2>/dev/null)" ]; then
  echo "installing postgresql from Debian"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  # The Debian package would try to create and start a cluster through invoke-rc.d; we do both below.
  apt-get install -y -q --no-install-recommends postgresql postgresql-client
fi

PG_VERSION="$(ls /usr/lib/postgresql | sort -V | tail -n 1)"
PG_BIN="/usr/lib/postgresql/$PG_VERSION/bin"

if ! pg_lsclusters -h 2>/dev/null | awk '{print $1" "$2}' | grep -qx "$PG_VERSION main"; then
  echo "creating cluster $PG_VERSION/main on port $PG_PORT"
  pg_createcluster "$PG_VERSION" main --port "$PG_PORT" >/dev/null
fi

status="$(pg_lsclusters -h | awk -v v="$PG_VERSION" '$1==v && $2=="main" {print $4}')"
if [ "$status" != "online" ]; then
  echo "starting cluster $PG_VERSION/main"
  # pg_ctlcluster, not systemctl: CI containers run no init system. It drops to the postgres user itself.
  pg_ctlcluster --skip-systemctl-redirect "$PG_VERSION" main start 2>/dev/null \
    || pg_ctlcluster "$PG_VERSION" main start
fi

for _ in $(seq 1 60); do
  if "$PG_BIN/pg_isready" -q -h 127.0.0.1 -p "$PG_PORT"; then break; fi
  sleep 0.5
done
"$PG_BIN/pg_isready" -h 127.0.0.1 -p "$PG_PORT"

as_postgres() { su postgres -s /bin/sh -c "$1"; }
psql_admin() { as_postgres "psql -v ON_ERROR_STOP=1 -qAt -p $PG_PORT -c \"$1\""; }

if [ "$(psql_admin "SELECT 1 FROM pg_roles WHERE rolname='$PG_ROLE'")" != "1" ]; then
  echo "creating role $PG_ROLE"
  # CREATEDB lets the tests make throwaway databases if they want them; they use schemas by default.
  psql_admin "CREATE ROLE $PG_ROLE LOGIN CREATEDB PASSWORD '$PG_PASSWORD'"
fi
if [ "$(psql_admin "SELECT 1 FROM pg_database WHERE datname='$PG_DB'")" != "1" ]; then
  echo "creating database $PG_DB"
  psql_admin "CREATE DATABASE $PG_DB OWNER $PG_ROLE"
fi

line="export RUNYARD_TEST_PG_URL=postgresql+psycopg://$PG_ROLE:$PG_PASSWORD@127.0.0.1:$PG_PORT/$PG_DB"
touch .ci/env
grep -qxF "$line" .ci/env || echo "$line" >> .ci/env
echo "postgresql $PG_VERSION ready: $line"
