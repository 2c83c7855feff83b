"""`python -m benchmarks max-batch`: the search (doubling, then bisection) and its CPU behaviour."""
from __future__ import annotations

import pytest
from conftest import BENCHMARKS, run

from benchmarks.max_batch import NEEDS_GPU, Trial, format_trials, search_max_batch


@pytest.mark.parametrize("capacity,start,granularity,expected", [
    (300, 256, 8, 296),   # 256 fits, 512 not: bisect 384, 320, 288, 304, 296
    (300, 32, 1, 300),    # exact
    (1000, 256, 8, 1000), # 256, 512 fit, 1024 not: 768, 896, 960, 992, 1000 (a multiple of 8)
    (5, 256, 8, 5),       # the start does not fit: bisect down below it, to single images
    (0, 4, 8, 0)])        # nothing fits
def test_search_finds_the_largest_fitting_batch(capacity, start, granularity, expected):
    tried = []

    def fits(batch):
        tried.append(batch)
        return batch <= capacity
    assert search_max_batch(fits, start, granularity) == expected
    assert len(tried) == len(set(tried)) and len(tried) <= 20


def test_search_doubles_first():
    tried = []
    search_max_batch(lambda b: tried.append(b) or b <= 2000, 16, 8)
    assert tried[:8] == [16, 32, 64, 128, 256, 512, 1024, 2048]


def test_table_marks_the_largest_batch():
    text = format_trials([Trial(256, True, 1500.0, 30000.0), Trial(512, False, reason="out of memory")], "GPU X")
    assert "largest per-GPU batch on GPU X: 256" in text
    assert "| 256 (largest) | 1500.0 | 30000 | yes |" in text and "| 512 | - | - | no: out of memory |" in text


def test_on_a_cpu_it_explains_that_it_needs_a_gpu_and_exits_non_zero():
    proc = run([*BENCHMARKS, "max-batch", "--arch", "resnet18"])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr  # it measured nothing: a script must not go on
    assert proc.stderr.strip() == f"hybridtrain: error: {NEEDS_GPU}" and proc.stdout == ""
