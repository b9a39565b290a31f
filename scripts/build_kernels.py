"""Build the compiled CPU kernels ahead of their first use: every build this CPU can execute, its own first.

`make install` (and so `make test` and `make demo` on a fresh checkout) starts this in the background once torch is
installed, so the builds (1-2 min each on 2 cores) run while pip fetches the other packages instead of at the first
kernel call. Whoever loads a build that is still compiling waits for it (the build folder's lock,
llmopt/runtime/executor/kernels/build_lock.py); a build that fails here is tried again at its first use. It needs
only torch and this checkout on the path (PYTHONPATH), not llmopt's other dependencies.

    python scripts/build_kernels.py            # prints each build's ISA and seconds, or why it is unavailable
"""

from __future__ import annotations

import sys
import time

from llmopt.core.hardware import kernel_isa, supported_kernel_isas
from llmopt.runtime.executor.kernels.cpu_ops import cpu_ops


def main() -> int:
    native = kernel_isa()
    # this CPU's build first (the first one anything loads), then the lower ones the tests load beside it
    order = [native] + [isa for isa in reversed(supported_kernel_isas()) if isa != native]
    failed = 0
    for isa in order:
        start = time.monotonic()
        built = cpu_ops(isa) is not None  # (None: cpu_ops logged why)
        failed += not built
        print(f"{isa}: {'built' if built else 'unavailable'} in {time.monotonic() - start:.0f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
