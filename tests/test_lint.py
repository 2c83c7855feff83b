"""The lint the code keeps (ruff.toml: pyflakes, pycodestyle, sorted imports, 120-character lines), run by the
README's test command like every other test."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import REPO


def test_the_package_and_the_tests_pass_the_lint():
    ruff = os.path.join(os.path.dirname(sys.executable), "ruff")
    if not os.path.exists(ruff):
        pytest.fail("ruff is not installed in this environment: rerun ./install.sh (it is in the dev extra)")
    proc = subprocess.run([ruff, "check", "hybridtrain", "tests"], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
