"""Whether this host has a working NVIDIA driver: tests of what watch does without one skip where it has
one (a GPU machine), and run everywhere else, CI included."""

from __future__ import annotations


def nvml_works() -> bool:
    """NVML initialises here (and is shut down again)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return False
    pynvml.nvmlShutdown()
    return True
