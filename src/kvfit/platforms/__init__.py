"""Platforms measure memory and name their attention backend; the block math lives in kv/plan.py."""

from kvfit.platforms.base import Platform, StartupSteps, get_platform

__all__ = ["Platform", "StartupSteps", "get_platform"]
