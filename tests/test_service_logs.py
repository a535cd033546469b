"""A service's log is one JSON object per line, whatever its libraries write
(`leap.runtime.logging.library_output_as_logs`, what `leap serve` runs a service inside).

A child process does what used to break the log of the trainer (transformers' "Loading
weights" and "Writing model shards" progress bars on every model load and checkpoint) and
what libraries do besides: a transformers warning, `warnings.warn`, a stray print, an
uncaught exception in a thread. The trainer's own log during a real run is checked in
tests/test_trainer_e2e.py."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT, subprocess_env

CHILD = r"""
import sys, threading, warnings
from leap.runtime.logging import configure_logging, library_output_as_logs

configure_logging("info", service="trainer")
with library_output_as_logs():
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    from tests.tiny_lm import build_tiny_model

    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(sys.argv[1]), local_files_only=True)
    model.save_pretrained(sys.argv[2])
    hf_logging.get_logger("transformers.modeling_utils").warning("a transformers warning")
    warnings.warn("a library warning")
    print("a stray print")
    thread = threading.Thread(target=lambda: 1 / 0, name="doomed")
    thread.start()
    thread.join()
print("leap serve: a friendly last line", file=sys.stderr)
"""


def test_library_output_becomes_json_lines_and_progress_bars_are_gone(tmp_path):
    done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "model"), str(tmp_path / "saved")],
                          env=subprocess_env(), cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
    lines = done.stdout.decode().splitlines()
    assert done.returncode == 0, "\n".join(lines)
    assert (tmp_path / "saved" / "model.safetensors").is_file()
    assert lines[-1] == "leap serve: a friendly last line"  # streams are restored once the service ends
    records = [json.loads(line) for line in lines[:-1]]  # every other line is one JSON object
    assert not any("Loading weights" in r["event"] or "Writing model shards" in r["event"] for r in records)
    by_event = {r["event"].splitlines()[0]: r for r in records}
    assert by_event["a transformers warning"]["logger"] == "transformers.modeling_utils"
    assert any(r["logger"] == "py.warnings" and "a library warning" in r["event"] for r in records if "logger" in r)
    assert by_event["a stray print"]["stream"] == "stdout"
    crash = by_event["uncaught exception in a thread"]
    assert crash["thread"] == "doomed" and crash["exception"][0]["exc_type"] == "ZeroDivisionError"
    assert all(r["service"] == "trainer" for r in records)
