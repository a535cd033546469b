"""Other languages against a real reward service: the Node.js test client
(tests/node/client.js: @grpc/grpc-js + @grpc/proto-loader) and README.md's section "Calling a
service from another language" run as written — its Node.js client, its retry service config,
and its TypeScript generation (buf.gen.yaml, protoc-gen-es), build (tsc) and client
(tests/node/ts/client.ts, Connect's gRPC transport). The npm packages come from the README's
test command (`npm ci --prefix tests/node`); the generated code and the build go to the
ignored tests/node/gen/ and tests/node/build/."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import pytest

from leap.clients.channel import service_config
from tests.conftest import ROOT, leap_serve

NODE_DIR = ROOT / "tests" / "node"
README_ADDRESS = "127.0.0.1:50053"  # the address the README's commands use


@pytest.fixture(scope="module")
def reward():
    if shutil.which("node") is None:
        pytest.fail("node is not installed: the README's test command needs Node.js 18+")
    if not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir():
        pytest.fail("tests/node/node_modules is missing: run `npm ci --prefix tests/node` (part of the test command)")
    with leap_serve("reward", "--history-path", "") as (address, _process):
        yield address


def readme_block(marker: str) -> str:
    """The fenced block right after `<!-- marker -->` in README.md."""
    text = (ROOT / "README.md").read_text()
    found = re.search(rf"<!-- {marker} -->\n```[a-z]*\n(.*?)\n```", text, re.DOTALL)
    assert found, f"README.md has no block marked <!-- {marker} -->"
    return found.group(1)


def node(*args: str, **kwargs) -> str:
    result = subprocess.run(["node", *args], capture_output=True, text=True, timeout=60, cwd=ROOT, **kwargs)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_node_client_calls_health_and_rank(reward):
    out = json.loads(node(str(NODE_DIR / "client.js"), reward))
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


def test_the_readmes_retry_config_is_the_python_clients_policy():
    shipped = json.loads((ROOT / "protos" / "service_config.json").read_text())
    assert json.loads(readme_block("service-config")) == shipped == json.loads(service_config())
    (policy,) = shipped["methodConfig"]
    assert policy["retryPolicy"]["retryableStatusCodes"] == ["UNAVAILABLE"]


def test_the_readmes_node_client_runs_as_written(reward, tmp_path):
    script = tmp_path / "client.js"
    script.write_text(readme_block("node-client") + "\n")
    out = node(str(script), reward, env={**os.environ, "NODE_PATH": str(NODE_DIR / "node_modules")})
    assert out.strip() == readme_block("node-client-output")


def test_the_readmes_typescript_generation_build_and_client_run_as_written(reward):
    commands = readme_block("ts-client").splitlines()
    assert commands[0].startswith("npm ci --prefix tests/node")  # the README's test command has run it
    assert (ROOT / ".venv" / "bin" / "buf").exists(), "the README's commands use .venv/bin/buf (the test extra)"
    shutil.rmtree(NODE_DIR / "build", ignore_errors=True)
    script = "set -euo pipefail\n" + "\n".join(commands[1:]).replace(README_ADDRESS, reward)
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    generated = {p.relative_to(NODE_DIR / "gen" / "ts").as_posix() for p in (NODE_DIR / "gen" / "ts").rglob("*_pb.ts")}
    assert {"leap/reward/v1/reward_pb.ts", "leap/trainer/v1/trainer_pb.ts", "google/rpc/error_details_pb.ts"} <= generated
    assert result.stdout.strip() == readme_block("ts-client-output")
