"""A serving process freezes what start-up left alive and spaces its young collections out (gc_tuning); checked in
a child process, so this test process's collector stays CPython's."""

from __future__ import annotations

import subprocess
import sys

CHILD = """
import gc
from kvfit.server.gc_tuning import OLDER_THRESHOLDS, YOUNG_THRESHOLD, tune_gc_after_startup
alive = [[i] for i in range(1000)]
tune_gc_after_startup("test")
assert gc.get_threshold() == (YOUNG_THRESHOLD, *OLDER_THRESHOLDS), gc.get_threshold()
assert gc.get_freeze_count() >= 1000, gc.get_freeze_count()
a = []; a.append(a); del a              # cycles are still collected
assert gc.collect() >= 1
print("ok")
"""


def test_tuning_freezes_startup_and_raises_the_young_threshold():
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
