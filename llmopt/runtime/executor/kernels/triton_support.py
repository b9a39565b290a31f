"""Whether the Triton kernels can run in this environment (the package installed)."""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
