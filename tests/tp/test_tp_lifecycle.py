"""No orphans: the ranks exit when the engine's process exits without shutdown() (atexit), and
when it is killed outright (each rank watches its parent). Each case runs an engine in a fresh
Python process that prints its ranks' process ids.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from tp_helpers import ENGINE_KWARGS, all_gone

SCRIPT = """
import os, signal, sys
import torch
from kvfit import LLM

if __name__ == "__main__":
    torch.set_num_threads(2)
    folder, how, kwargs = sys.argv[1], sys.argv[2], eval(sys.argv[3])
    llm = LLM(folder, tensor_parallel_size=2, **kwargs)
    print(" ".join(str(pid) for pid in llm.engine.workers.pids), flush=True)
    if how == "killed":
        os.kill(os.getpid(), signal.SIGKILL)
    # "exits": leave with the engine running and no shutdown()
"""


@pytest.mark.parametrize("how", ["exits", "killed"])
def test_ranks_do_not_outlive_the_engine_process(tiny_llama, how):
    run = subprocess.run([sys.executable, "-c", SCRIPT, tiny_llama, how, repr(ENGINE_KWARGS)],
                         capture_output=True, text=True, timeout=120)
    lines = run.stdout.strip().splitlines()
    assert lines, run.stderr[-2000:]
    pids = [int(pid) for pid in lines[-1].split()]
    assert len(pids) == 1
    if how == "exits":
        assert run.returncode == 0, run.stderr[-2000:]
        assert all_gone(pids, timeout_s=0), "the ranks were still running when the engine's process exited"
    else:
        assert run.returncode == -9
        assert all_gone(pids, timeout_s=10), "a rank outlived its killed parent"
