"""A test session cleans up after itself: its sandbox (HOME, caches, TMPDIR, every tmp_path) is removed at the end."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent


@pytest.mark.slow  # a pytest session of its own: a few seconds of imports
def test_a_pytest_session_removes_its_sandbox(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    env.pop("SERVOPT_KEEP_TEST_SANDBOX", None)
    for key in ("HOME", "XDG_CACHE_HOME", "TORCHINDUCTOR_CACHE_DIR", "SERVOPT_HOME"):
        env.pop(key, None)  # this session's sandbox paths: the child makes its own
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           f"{TESTS / 'test_contracts.py'}::test_unknown_names_list_the_known_ones"],
                          env=env, capture_output=True, text=True, cwd=TESTS.parent, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert not list(tmp_path.glob("servopt-tests-*")), "the child session's sandbox was left behind"
    kept = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           f"{TESTS / 'test_contracts.py'}::test_unknown_names_list_the_known_ones"],
                          env={**env, "SERVOPT_KEEP_TEST_SANDBOX": "1"}, capture_output=True, text=True, cwd=TESTS.parent, timeout=300)
    assert kept.returncode == 0 and len(list(tmp_path.glob("servopt-tests-*"))) == 1, "kept when asked"
