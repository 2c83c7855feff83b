"""The slowest test files start first under `make test`'s pytest-xdist: conftest.FILE_WEIGHTS names
files that exist, and a real pytest run with --dist loadfile takes a listed file before a file of more tests."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

from conftest import FILE_WEIGHTS, REPO


def test_every_weighted_file_exists():
    missing = [name for name in FILE_WEIGHTS if not os.path.isfile(os.path.join(REPO, "tests", name))]
    assert not missing, f"conftest.FILE_WEIGHTS names files that are gone: {missing}"


def test_a_weighted_file_runs_before_a_file_of_more_tests(tmp_path):
    """xdist's own order would be the file of three tests first (most tests first); one worker runs its queue in
    order, so the order of the 'ran' lines is the queue's."""
    shutil.copy(os.path.join(REPO, "tests", "conftest.py"), tmp_path / "conftest.py")
    heavy, light = min(FILE_WEIGHTS, key=lambda name: -FILE_WEIGHTS[name]), "test_light.py"
    (tmp_path / heavy).write_text("def test_one():\n    print('ran heavy')\n")
    (tmp_path / light).write_text("".join(f"def test_{i}():\n    print('ran light')\n\n\n" for i in range(3)))
    order = {}
    for extra in ([], ["--loadscope-reorder"]):
        proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "1", "--dist", "loadfile",
                               "-v", *extra, str(tmp_path)], capture_output=True, text=True, cwd=tmp_path, timeout=300)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        order[tuple(extra)] = [os.path.basename(word.split("::")[0]) for line in proc.stdout.splitlines()
                               if "PASSED" in line for word in line.split() if "::" in word]
    assert order[()] == [heavy, light, light, light], order
    assert order[("--loadscope-reorder",)] == [light, light, light, heavy], order  # xdist's order, asked for
