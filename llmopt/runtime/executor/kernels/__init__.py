"""Runtime kernels, one file per op, each with a plain-torch reference."""
