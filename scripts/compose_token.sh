#!/usr/bin/env bash
# Write a random bearer token for the compose stack to compose/.env (LEAP_AUTH_TOKEN=...),
# readable by you alone; Compose reads that file by itself. Keeps an existing token unless
# --new is given. Clients send the same token: `LEAP_AUTH_TOKEN=... leap conformance ...` (or --auth-token-file),
# or LEAP_AUTH_TOKEN in their environment (`set -a; . compose/.env; set +a`).
#   scripts/compose_token.sh [--new] [FILE]        (FILE defaults to compose/.env)
set -euo pipefail
new=0
if [ "${1:-}" = "--new" ]; then new=1; shift; fi
file=${1:-"$(cd "$(dirname "$0")/.." && pwd)/compose/.env"}
if [ -f "$file" ] && grep -q '^LEAP_AUTH_TOKEN=.' "$file" && [ "$new" = 0 ]; then
  echo "compose_token.sh: $file already has a token (--new replaces it)" >&2
  exit 0
fi
token=$(python3 -c 'import secrets; print(secrets.token_urlsafe(32))')
umask 077
touch "$file"
{ grep -v '^LEAP_AUTH_TOKEN=' "$file" || true; echo "LEAP_AUTH_TOKEN=$token"; } >"$file.tmp"
mv "$file.tmp" "$file"
chmod 600 "$file"
echo "compose_token.sh: wrote a new LEAP_AUTH_TOKEN to $file" >&2
