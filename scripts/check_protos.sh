#!/usr/bin/env bash
# Check the contracts under protos/ as CI does (tests/test_contracts.py runs this script):
#   buf lint      STANDARD + COMMENTS (every message, field, enum value and RPC documented)
#   buf breaking  FILE rules against a git ref: the previous commit by default, or the ref
#                 given (scripts/check_protos.sh main); skipped when the ref is not in this
#                 checkout (a first commit, a shallow clone)
#   bindings      the committed Python bindings against a fresh generation (scripts/gen_protos.py)
# buf comes from the buf-bin package of the test extra (pip install -e '.[test]').
set -euo pipefail
cd "$(dirname "$0")/.."
against="${1:-HEAD~1}"
python="${PYTHON:-.venv/bin/python}"
[ -x "$python" ] || python=python3
buf="$(command -v buf || true)"
[ -n "$buf" ] || buf=.venv/bin/buf
if [ ! -x "$buf" ] && ! command -v "$buf" >/dev/null; then
  echo "check_protos: no buf binary: pip install -e '.[test]' (it brings buf-bin)" >&2
  exit 2
fi

"$buf" lint
echo "buf lint: ok"
if git cat-file -e "${against}:buf.yaml" 2>/dev/null; then
  "$buf" breaking --against ".git#ref=${against}"
  echo "buf breaking against ${against}: ok"
else
  echo "buf breaking: skipped (${against} is not in this checkout, or has no contracts)"
fi
"$python" scripts/gen_protos.py --check
echo "bindings: ok"
