#!/bin/sh
# Initialize a cluster (POSTGRES_USER / POSTGRES_PASSWORD / POSTGRES_DB, like the official
# image; the password is required) and run the server with the command's settings (e.g.
# postgres -c shared_buffers=512MB). Runs as the postgres user throughout (the image's USER).
set -eu
BIN=$(ls -d /usr/lib/postgresql/*/bin | tail -n 1)
DATA=/var/lib/kvledger-pg/data
USER_NAME=${POSTGRES_USER:-postgres}
DB=${POSTGRES_DB:-$USER_NAME}
if [ ! -f "$DATA/PG_VERSION" ]; then
  if [ -z "${POSTGRES_PASSWORD:-}" ]; then
    echo "kvledger-postgres: POSTGRES_PASSWORD is required" >&2
    exit 1
  fi
  PWFILE=$(mktemp)
  printf '%s\n' "$POSTGRES_PASSWORD" > "$PWFILE"
  "$BIN/initdb" -D "$DATA" -U "$USER_NAME" --pwfile="$PWFILE" --auth=scram-sha-256 \
    -E UTF8 --locale=C.UTF-8 > /dev/null
  rm -f "$PWFILE"
  echo "host all all 0.0.0.0/0 scram-sha-256" >> "$DATA/pg_hba.conf"
  if [ "$DB" != "postgres" ]; then
    # Single-user mode: no server, no connection, no password on any command line.
    echo "CREATE DATABASE \"$DB\" OWNER \"$USER_NAME\"" \
      | "$BIN/postgres" --single -D "$DATA" postgres > /dev/null
  fi
fi
echo "kvledger-postgres: starting"
# Like the official image: a command starting with "postgres" passes its settings on.
[ "${1:-}" = postgres ] && shift
exec "$BIN/postgres" -D "$DATA" -c listen_addresses='*' "$@"
