#!/bin/sh
# Initialize a cluster (POSTGRES_USER / POSTGRES_PASSWORD / POSTGRES_DB) and run the server
# with the command's settings (e.g. postgres -c shared_buffers=512MB).
set -eu
BIN=$(ls -d /usr/lib/postgresql/*/bin | tail -n 1)
DATA=/var/lib/kvledger-pg
USER_NAME=${POSTGRES_USER:-postgres}
PASSWORD=${POSTGRES_PASSWORD:-postgres}
DB=${POSTGRES_DB:-$USER_NAME}
if [ ! -f "$DATA/PG_VERSION" ]; then
  mkdir -p "$DATA" && chown postgres: "$DATA"
  printf '%s\n' "$PASSWORD" > /tmp/pw && chown postgres: /tmp/pw
  su postgres -c "$BIN/initdb -D $DATA -U $USER_NAME --pwfile=/tmp/pw --auth=scram-sha-256 -E UTF8 --locale=C.UTF-8" > /dev/null
  rm -f /tmp/pw
  echo "host all all 0.0.0.0/0 scram-sha-256" >> "$DATA/pg_hba.conf"
  su postgres -c "$BIN/pg_ctl -D $DATA -o '-c listen_addresses=' -w start" > /dev/null
  if [ "$DB" != "postgres" ]; then
    su postgres -c "PGPASSWORD='$PASSWORD' $BIN/psql -q -h /var/run/postgresql -U $USER_NAME -d postgres -c 'CREATE DATABASE \"$DB\"'" 2>/dev/null \
      || su postgres -c "$BIN/psql -q -U $USER_NAME -d postgres -c 'CREATE DATABASE \"$DB\"'"
  fi
  su postgres -c "$BIN/pg_ctl -D $DATA -m fast -w stop" > /dev/null
fi
mkdir -p /var/run/postgresql && chown postgres: /var/run/postgresql
echo "kvledger-postgres: starting"
# Like the official image: a command starting with "postgres" passes its settings on.
[ "${1:-}" = postgres ] && shift
exec su postgres -c "exec $BIN/postgres -D $DATA -c listen_addresses='*' $*"
