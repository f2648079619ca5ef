#!/bin/sh
# Start PostgreSQL the way the official postgres image does for the settings the stack uses:
# POSTGRES_USER, POSTGRES_PASSWORD (or POSTGRES_PASSWORD_FILE), POSTGRES_DB; data in $PGDATA;
# password (scram-sha-256) authentication for every TCP client.
set -eu
bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)
user=${POSTGRES_USER:-postgres}
if [ -n "${POSTGRES_PASSWORD_FILE:-}" ]; then
    POSTGRES_PASSWORD=$(cat "$POSTGRES_PASSWORD_FILE")
fi
if [ -z "${POSTGRES_PASSWORD:-}" ]; then
    echo "error: POSTGRES_PASSWORD (or POSTGRES_PASSWORD_FILE) is not set" >&2
    exit 1
fi
if [ ! -s "$PGDATA/PG_VERSION" ]; then
    pwfile=$(mktemp)
    printf '%s' "$POSTGRES_PASSWORD" > "$pwfile"
    "$bin/initdb" --pgdata="$PGDATA" --username="$user" --pwfile="$pwfile" \
        --encoding=UTF8 --locale=C.UTF-8 --auth-local=trust --auth-host=scram-sha-256 >/dev/null
    rm -f "$pwfile"
    echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
    db=${POSTGRES_DB:-$user}
    if [ "$db" != postgres ]; then
        echo "CREATE DATABASE \"$db\" OWNER \"$user\";" | "$bin/postgres" --single -D "$PGDATA" postgres >/dev/null
    fi
fi
exec "$bin/postgres" -D "$PGDATA" -c listen_addresses='*' -c unix_socket_directories=/tmp
