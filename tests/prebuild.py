"""Session artifacts built outside pytest-timeout's per-test limit, beside the tests that do
not need them (issue #15, item 11).

pytest-timeout counts a fixture's setup against the test that first asks for it, so a
session fixture that builds something for minutes (the tiny model: about 5 minutes on two
busy cores) fails that test with `Failed: Timeout` on a slow machine, and every test using
it errors. A `prebuilt` fixture is built instead by a child process that
`pytest_collection_finish` starts, after collection, when a selected test uses it (not at
all otherwise); the builder's own output, its progress bar, goes to a log file named on the
terminal. The test modules that use no prebuilt fixture run first (each module's own order
kept), on the other core while it builds; before the first test that needs one, the session
waits for it outside that test's timeout (a hookwrapper around pytest-timeout's), with a
line of progress. The fixture then only hands out the result. A build that fails fails the
tests that use it, with the end of its log; the others run.

    tiny_model_dir = prebuilt("tiny_model_dir", build_tiny_model)   # in a conftest.py
    from tests.prebuild import (pytest_collection_finish, pytest_collection_modifyitems,
                                pytest_runtest_protocol, pytest_sessionfinish)  # the hooks

The builder must be a module-level function (the child imports it by module and name) whose
result pickles; any other is built in the session's own process before the tests, as before.
"""

from __future__ import annotations

import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

_BUILDERS: dict[str, Callable[[], Any]] = {}
_RESULTS: dict[str, tuple[bool, Any]] = {}  # name -> (ok, value or the exception)
_PENDING: dict[str, tuple[subprocess.Popen, Path, Path, float]] = {}  # name -> (child, result, log, started)

# The child: import the builder by module and name, build, pickle the result.
_CHILD = ("import importlib, pickle, sys; build = getattr(importlib.import_module(sys.argv[1]), sys.argv[2]); "
          "value = build(); open(sys.argv[3], 'wb').write(pickle.dumps(value))")


def prebuilt(name: str, build: Callable[[], Any]):
    """A session fixture `name` whose value `build()` makes before the tests that use it."""
    _BUILDERS[name] = build

    @pytest.fixture(scope="session", name=name)
    def fixture() -> Any:
        if name in _PENDING:  # a plugin reordered the tests: wait here
            _wait(name, None)
        if name not in _RESULTS:  # not selected at collection (a plugin added it later): build now
            _build(name, None)
        ok, value = _RESULTS[name]
        if not ok:
            raise RuntimeError(f"building {name} before the tests failed: {value!r}") from value
        return value

    fixture.__doc__ = build.__doc__
    return fixture


def _say(config: pytest.Config | None, line: str) -> None:
    reporter = config.pluginmanager.get_plugin("terminalreporter") if config is not None else None
    if reporter is not None:
        reporter.write_line(line)


def _build(name: str, config: pytest.Config | None) -> None:
    """Build in this process (a builder the child cannot import)."""
    capture = config.pluginmanager.get_plugin("capturemanager") if config is not None else None
    _say(config, f"building {name} before the tests start (outside the per-test timeout) ...")
    started = time.monotonic()
    try:
        if capture is not None:
            with capture.global_and_fixture_disabled():
                value = _BUILDERS[name]()
        else:
            value = _BUILDERS[name]()
    except Exception as err:  # reported by every test that uses it
        _RESULTS[name] = (False, err)
        _say(config, f"building {name} failed after {time.monotonic() - started:.0f} s: {err!r}")
        return
    _RESULTS[name] = (True, value)
    _say(config, f"{name} ready after {time.monotonic() - started:.0f} s")


def _importable(build: Callable[[], Any]) -> bool:
    module = sys.modules.get(build.__module__)
    return module is not None and "<" not in build.__qualname__ and getattr(module, build.__name__, None) is build


def _start(name: str, config: pytest.Config) -> None:
    build = _BUILDERS[name]
    if not _importable(build):
        _build(name, config)
        return
    directory = Path(tempfile.mkdtemp(prefix=f"prebuild-{name}-"))
    result, log = directory / "result.pickle", directory / "build.log"
    with log.open("wb") as out:
        child = subprocess.Popen([sys.executable, "-c", _CHILD, build.__module__, build.__name__, str(result)],
                                 cwd=config.rootpath, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    _PENDING[name] = (child, result, log, time.monotonic())
    _say(config, f"building {name} in the background while the tests that do not need it run (log: {log}) ...")


def _wait(name: str, config: pytest.Config | None) -> None:
    child, result, log, started = _PENDING.pop(name)
    if child.poll() is None:
        _say(config, f"waiting for {name} (building for {time.monotonic() - started:.0f} s) ...")
    try:
        code = child.wait()
    except BaseException:  # an interrupt while waiting: the build goes with the session
        child.terminate()
        child.wait()
        raise
    if code == 0:
        _RESULTS[name] = (True, pickle.loads(result.read_bytes()))
        shutil.rmtree(result.parent, ignore_errors=True)  # the log stays only where a build failed
        _say(config, f"{name} ready after {time.monotonic() - started:.0f} s")
        return
    tail = "\n".join(log.read_text(errors="replace").replace("\r", "\n").splitlines()[-15:])
    _RESULTS[name] = (False, RuntimeError(f"the build exited with status {code}; the end of {log}:\n{tail}"))
    _say(config, f"building {name} failed after {time.monotonic() - started:.0f} s (log: {log})")


def _needs(item: pytest.Item) -> list[str]:
    return [name for name in getattr(item, "fixturenames", ()) if name in _BUILDERS]


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """The modules none of whose tests needs a prebuilt fixture first."""
    waiting = {item.nodeid.split("::")[0] for item in items if _needs(item)}
    items[:] = ([item for item in items if item.nodeid.split("::")[0] not in waiting]
                + [item for item in items if item.nodeid.split("::")[0] in waiting])


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return
    needed = {name for item in session.items for name in _needs(item)}
    for name in sorted(needed):
        if name not in _RESULTS and name not in _PENDING:
            _start(name, session.config)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    """Outermost, so pytest-timeout's timer starts after the wait."""
    for name in _needs(item):
        if name in _PENDING:
            _wait(name, item.config)
    yield


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A build still running when the session ends (every test that needed it deselected by
    -x, or an interrupt) is stopped."""
    for name in list(_PENDING):
        child, result = _PENDING.pop(name)[:2]
        if child.poll() is None:
            child.terminate()
            child.wait()
        shutil.rmtree(result.parent, ignore_errors=True)
