#!/bin/bash
# Run once by the postgres image when it initializes the primary (docker-entrypoint-initdb.d):
# with KVLEDGER_REPLICATOR_PASSWORD set, a replication login for the optional hot standby
# (docker compose --profile standby) and the pg_hba line that lets it stream.
set -euo pipefail
if [ -z "${KVLEDGER_REPLICATOR_PASSWORD:-}" ]; then
  echo "kvledger: no KVLEDGER_REPLICATOR_PASSWORD: no replication role (no standby)"
  exit 0
fi
psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --dbname postgres <<SQL
CREATE ROLE kvledger_replicator LOGIN REPLICATION PASSWORD '${KVLEDGER_REPLICATOR_PASSWORD}';
SQL
echo "host replication kvledger_replicator all scram-sha-256" >> "$PGDATA/pg_hba.conf"
