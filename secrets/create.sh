#!/bin/sh
# Creates the secrets compose.yaml reads (docs/security.md), each only if it is missing: Redis
# passwords for the router, agent and admin users, and the routers' API key. The directory is
# yours alone (700); the files are 644 because compose mounts them as they are, and the services
# read them as their own (non-root) users.
# The one command to start the stack:   ./secrets/create.sh && docker compose --profile sim up
set -eu
cd "$(dirname "$0")"
chmod 700 .
for name in redis-router-password redis-agent-password redis-admin-password router-api-keys; do
  if [ ! -s "$name" ]; then
    (umask 077 && openssl rand -hex 32 > "$name")
    chmod 644 "$name"
    echo "created secrets/$name"
  fi
done
echo "clients send the header: Authorization: Bearer <the first line of secrets/router-api-keys>" >&2
