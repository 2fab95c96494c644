"""The one version: pyproject.toml's, as installed (importable from every layer, no torch)."""

from importlib import metadata

try:
    __version__ = metadata.version("kvfit")
except metadata.PackageNotFoundError:             # run from a source tree that was never installed
    __version__ = "0+unknown"
