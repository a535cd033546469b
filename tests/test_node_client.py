"""Another language: a Node.js client (@grpc/grpc-js + @grpc/proto-loader, from the npm
registry, installed by the README's test command) loads protos/ as shipped and calls a
running service: health, one RPC, and rich error details on bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from google.rpc import status_pb2

from tests.conftest import ROOT, leap_serve

NODE_DIR = ROOT / "tests" / "node"


def run_client(address: str) -> dict:
    if shutil.which("node") is None:
        pytest.fail("node is not installed: the README's test command needs Node.js 18+")
    if not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir():
        pytest.fail("tests/node/node_modules is missing: run `npm ci --prefix tests/node` (part of the test command)")
    googleapis = Path(status_pb2.__file__).parent.parent.parent  # site-packages, holding google/rpc/*.proto
    result = subprocess.run(["node", str(NODE_DIR / "client.js"), address, str(googleapis)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_node_client_calls_health_and_rank():
    with leap_serve("reward") as (address, _process):
        out = run_client(address)
    assert out["health"] == "SERVING"
    # The group: passed at 2x, compile error, passed at 1x (all 100 tokens). The 2x beats both,
    # the 1x beats the compile error: rewards (wins - losses) / (G - 1) = 1, -1, 0.
    (result,) = out["rank"]["results"]
    assert result["task_id"] == "relu"
    scored = [(t["reward"], t["advantage"], t["wins"], t["losses"], t["ties"], t["turn_advantages"])
              for t in result["trajectories"]]
    assert scored == [(1, 1, 2, 0, 0, [1]), (-1, -1, 0, 2, 0, [-1]), (0, 0, 1, 1, 0, [0])]
    # Rank with no groups: INVALID_ARGUMENT, with a google.rpc.BadRequest decoded in Node.
    assert out["bad"]["code"] == "INVALID_ARGUMENT"
    (detail,) = out["bad"]["rich"]
    assert detail["type"] == "google.rpc.BadRequest"
    (violation,) = detail["value"]["field_violations"]
    assert violation["field"] == "groups" and "at least one group" in violation["description"]
