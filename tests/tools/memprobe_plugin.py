"""pytest plugin: after every test, the device memory in use outside this process's torch allocator.

PYTHONPATH=src:tests/tools python -m pytest -q -s tests/gpu -p memprobe_plugin | grep memprobe
"""
import gc
import torch

def pytest_runtest_logfinish(nodeid, location):
    if not torch.cuda.is_available():
        return
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    used = total - free
    reserved = torch.cuda.memory_reserved()
    print(f"\n[memprobe] {nodeid}: used {used/2**30:.2f} GiB reserved {reserved/2**30:.2f} GiB "
          f"outside torch {(used-reserved)/2**30:.2f} GiB", flush=True)
