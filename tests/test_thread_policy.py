"""The OpenMP wait policy `leap` sets before torch loads (leap/__init__.py): PASSIVE unless the
user chose one, in a fresh interpreter, and in effect in the libgomp that torch loads."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.conftest import subprocess_env


def fresh_python(code: str, **env: str) -> subprocess.CompletedProcess:
    """`python -c CODE` in a fresh interpreter whose environment has no OMP_WAIT_POLICY but
    the one given in `env`."""
    base = {k: v for k, v in subprocess_env().items() if k != "OMP_WAIT_POLICY"}
    return subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True,
                          timeout=120, check=True)


def test_importing_leap_sets_a_passive_wait_policy_where_none_is_set():
    out = fresh_python("import leap, os; print(os.environ['OMP_WAIT_POLICY'])").stdout
    assert out.strip() == "PASSIVE"


def test_a_users_own_wait_policy_is_kept():
    out = fresh_python("import leap, os; print(os.environ['OMP_WAIT_POLICY'])", OMP_WAIT_POLICY="ACTIVE").stdout
    assert out.strip() == "ACTIVE"


def spin_count(stderr: str) -> int:
    found = re.search(r"GOMP_SPINCOUNT = '(\d+)'", stderr)
    if found is None:
        pytest.skip("torch's OpenMP runtime is not libgomp here (no OMP_DISPLAY_ENV report to read)")
    return int(found.group(1))


def test_the_policy_is_in_effect_in_the_openmp_runtime_torch_loads():
    # libgomp reports its settings at load with OMP_DISPLAY_ENV: with leap imported first, its
    # threads never spin (spin count 0); a user's ACTIVE still makes them spin.
    code = "import leap, torch; torch.ones(1 << 16).sum()"
    assert spin_count(fresh_python(code, OMP_DISPLAY_ENV="VERBOSE").stderr) == 0
    assert spin_count(fresh_python(code, OMP_DISPLAY_ENV="VERBOSE", OMP_WAIT_POLICY="ACTIVE").stderr) > 0


def test_the_leap_command_sets_it_before_it_loads_torch():
    # The services' entry point (`leap serve NAME` is leap.cli) imports torch only after leap.
    code = ("import sys, leap.cli, os; import torch; "
            "print(os.environ['OMP_WAIT_POLICY'], 'torch' in sys.modules)")
    assert fresh_python(code).stdout.split() == ["PASSIVE", "True"]
