"""Platforms measure memory and own their device's facts; the block math lives in kv/plan.py.

registry.py finds a platform by --device name; base.py is the interface (Platform, StartupSteps);
cpu.py and cuda.py the platforms; estimate.py a reading computed without a device (`kvfit plan`).
Importing this package loads only the registry (no torch, no config).
"""

from kvfit.platforms.registry import get_platform, platform_names

__all__ = ["get_platform", "platform_names"]
