"""Session artifacts built before the first test runs, outside pytest-timeout's per-test
limit (issue #15, item 11).

pytest-timeout counts a fixture's setup against the test that first asks for it, so a
session fixture that builds something for minutes (the tiny model: about 5 minutes on two
busy cores) fails that test with `Failed: Timeout` on a slow machine, and every test using
it errors. A `prebuilt` fixture is built instead in `pytest_collection_finish`, after
collection and before any test, when a selected test uses it (not at all otherwise), with a
line of progress on the terminal and pytest's capture off so the builder's own progress bar
shows. The fixture then only hands out the result. A build that fails fails the tests that
use it, with its error; the others run.

    tiny_model_dir = prebuilt("tiny_model_dir", build_tiny_model)   # in a conftest.py
    from tests.prebuild import pytest_collection_finish             # the hook, in that conftest
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

_BUILDERS: dict[str, Callable[[], Any]] = {}
_RESULTS: dict[str, tuple[bool, Any]] = {}  # name -> (ok, value or the exception)


def prebuilt(name: str, build: Callable[[], Any]):
    """A session fixture `name` whose value `build()` makes before the tests start."""
    _BUILDERS[name] = build

    @pytest.fixture(scope="session", name=name)
    def fixture() -> Any:
        if name not in _RESULTS:  # not selected at collection (a plugin added it later): build now
            _build(name, None)
        ok, value = _RESULTS[name]
        if not ok:
            raise RuntimeError(f"building {name} before the tests failed: {value!r}") from value
        return value

    fixture.__doc__ = build.__doc__
    return fixture


def _build(name: str, config: pytest.Config | None) -> None:
    reporter = config.pluginmanager.get_plugin("terminalreporter") if config is not None else None
    capture = config.pluginmanager.get_plugin("capturemanager") if config is not None else None
    say = reporter.write_line if reporter is not None else (lambda line: None)
    say(f"building {name} before the tests start (outside the per-test timeout) ...")
    started = time.monotonic()
    try:
        if capture is not None:
            with capture.global_and_fixture_disabled():
                value = _BUILDERS[name]()
        else:
            value = _BUILDERS[name]()
    except Exception as err:  # reported by every test that uses it
        _RESULTS[name] = (False, err)
        say(f"building {name} failed after {time.monotonic() - started:.0f} s: {err!r}")
        return
    _RESULTS[name] = (True, value)
    say(f"{name} ready after {time.monotonic() - started:.0f} s")


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return
    needed = {name for item in session.items for name in getattr(item, "fixturenames", ()) if name in _BUILDERS}
    for name in sorted(needed):
        if name not in _RESULTS:
            _build(name, session.config)
