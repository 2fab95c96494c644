"""Moved to kvfit.sampling_params (below engine and runner); kept for old imports."""

from kvfit.sampling_params import MIN_SAMPLING_TEMPERATURE, SamplingParams  # noqa: F401
