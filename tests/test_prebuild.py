"""tests/prebuild.py: a slow session build happens outside the per-test timeout, in a child
process beside the tests that do not need it, and only when a selected test needs it (issue
#15, item 11). Checked with a real pytest run in a subprocess, on fake builds that sleep past
a 1 s per-test timeout."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.conftest import subprocess_env

CONFTEST = """
import os
import time
from pathlib import Path
import pytest
from tests.prebuild import (prebuilt, pytest_collection_finish, pytest_collection_modifyitems,
                            pytest_runtest_protocol, pytest_sessionfinish)

MARK = Path(__file__).parent / "building"

def slow_build():
    MARK.write_text(str(os.getpid()))
    time.sleep(2.5)
    MARK.unlink()
    return "built"

def broken_build():
    raise OSError("the disk is full")

def unused_build():
    raise AssertionError("built although no selected test needs it")

slow_thing = prebuilt("slow_thing", slow_build)
broken_thing = prebuilt("broken_thing", broken_build)
unused_thing = prebuilt("unused_thing", unused_build)
inline_thing = prebuilt("inline_thing", lambda: "made here")  # not importable: built in this process

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

def test_needs_the_inline_one(inline_thing):
    assert inline_thing == "made here"

def test_deselected(unused_thing):
    pass

def test_plain_fixture(plain_slow_thing):
    assert plain_slow_thing == "built"
"""

OTHER = """
import os
import time
from pathlib import Path
import pytest

@pytest.mark.timeout(60)
def test_runs_while_it_builds():
    mark = Path(__file__).parent / "building"
    deadline = time.monotonic() + 50
    while not mark.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert int(mark.read_text()) != os.getpid()  # built by another process, still at it
"""


def test_prebuilt_fixtures_build_beside_the_tests_that_do_not_need_them_outside_any_timeout(tmp_path):
    (tmp_path / "conftest.py").write_text(textwrap.dedent(CONFTEST))
    (tmp_path / "test_fake.py").write_text(textwrap.dedent(TESTS))
    (tmp_path / "test_other.py").write_text(textwrap.dedent(OTHER))
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "--timeout", "1",
                           "--rootdir", str(tmp_path), "-k", "not deselected", "test_fake.py", "test_other.py"],
                          cwd=tmp_path, env=dict(subprocess_env(), TMPDIR=str(scratch)), capture_output=True,
                          text=True, timeout=300)
    out = done.stdout
    # The slow build ran once, in the background, while the module that needs none of it ran
    # first (named second on the command line), and no test's 1 s timeout covered the wait...
    assert out.count("building slow_thing in the background") == 1 and "slow_thing ready after" in out, out
    assert out.index("PASSED test_other.py::test_runs_while_it_builds") < out.index("PASSED test_fake.py::test_uses_it")
    assert "PASSED test_fake.py::test_uses_it" in out and "PASSED test_fake.py::test_uses_it_too" in out, out
    # ...while the same build in a plain session fixture fails its test with a timeout.
    assert "test_fake.py::test_plain_fixture" in out and "Timeout" in out, out
    # A failed build fails only the tests that use it, with its error; nothing unneeded is built;
    # a builder the child cannot import is built in the session's process.
    assert "ERROR test_fake.py::test_needs_the_broken_one" in out and "the disk is full" in out, out
    assert "PASSED test_fake.py::test_needs_the_inline_one" in out and "unused_thing" not in out, out
    # The builds' scratch directories are gone but the failed one's, which holds the log it names.
    left = sorted(path.name.rsplit("-", 1)[0] for path in scratch.iterdir())
    assert left == ["prebuild-broken_thing"] and (next(scratch.iterdir()) / "build.log").exists(), left
