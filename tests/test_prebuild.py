"""tests/prebuild.py: a slow session build happens before the tests, outside the per-test
timeout, and only when a selected test needs it (issue #15, item 11). Checked with a real
pytest run in a subprocess, on fake builds that sleep past a 1 s per-test timeout."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.conftest import subprocess_env

CONFTEST = """
import time
import pytest
from tests.prebuild import prebuilt, pytest_collection_finish

def slow_build():
    time.sleep(2.5)
    return "built"

def broken_build():
    raise OSError("the disk is full")

def unused_build():
    raise AssertionError("built although no selected test needs it")

slow_thing = prebuilt("slow_thing", slow_build)
broken_thing = prebuilt("broken_thing", broken_build)
unused_thing = prebuilt("unused_thing", unused_build)

@pytest.fixture(scope="session")
def plain_slow_thing():
    return slow_build()
"""

TESTS = """
def test_uses_it(slow_thing):
    assert slow_thing == "built"

def test_uses_it_too(slow_thing):
    assert slow_thing == "built"

def test_needs_the_broken_one(broken_thing):
    pass

def test_needs_nothing():
    pass

def test_deselected(unused_thing):
    pass

def test_plain_fixture(plain_slow_thing):
    assert plain_slow_thing == "built"
"""


def test_prebuilt_fixtures_are_built_before_the_tests_outside_their_timeout(tmp_path):
    (tmp_path / "conftest.py").write_text(textwrap.dedent(CONFTEST))
    (tmp_path / "test_fake.py").write_text(textwrap.dedent(TESTS))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "--timeout", "1",
                           "--rootdir", str(tmp_path), "-k", "not deselected", "test_fake.py"],
                          cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    out = done.stdout
    # The slow build ran once, before the tests, and no test's 1 s timeout covered it...
    assert out.count("building slow_thing before the tests start") == 1 and "slow_thing ready after" in out, out
    assert "PASSED test_fake.py::test_uses_it" in out and "PASSED test_fake.py::test_uses_it_too" in out, out
    # ...while the same build in a plain session fixture fails its test with a timeout.
    assert "test_fake.py::test_plain_fixture" in out and "Timeout" in out, out
    # A failed build fails only the tests that use it, with its error; nothing unneeded is built.
    assert "ERROR test_fake.py::test_needs_the_broken_one" in out and "the disk is full" in out, out
    assert "PASSED test_fake.py::test_needs_nothing" in out and "unused_thing" not in out, out
