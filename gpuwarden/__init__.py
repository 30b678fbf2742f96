"""gpuwarden: finds GPUs that are idle, leaking or saturated, and acts on them."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("gpuwarden")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
