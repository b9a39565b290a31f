"""What every linear with an 8-bit inputs' kernel (`q8`) shares: inputs rounded to int8 per row and block of 32
columns (dynamic, symmetric: llama.cpp's Q8 blocks), asked for by the engine's `--input-activations int8` (the CPU
default). Up to `q8_only_rows` rows (decode) only the 8-bit kernels run, as asked; beyond, `q8` is timed against
the layer's float paths with the rest (kernel_plans.py) and the faster runs (a float path being the more precise, a
step that takes one is never less accurate than asked)."""

from __future__ import annotations

from llmopt.runtime.executor.kernels.cpu_ops import cpu_ops

Q8_PATHS = ("q8", "q8_amx")  # the 8-bit inputs' kernels (q8_amx: the same numbers on AMX-INT8 tiles)


def takes_int8_inputs(acts) -> bool:
    """Whether `acts` (a LinearScheme's input_activations) asks for dynamic symmetric 8-bit integer inputs."""
    return acts is not None and acts.type == "int" and acts.bits == 8 and acts.dynamic and acts.sym


class Q8InputsMixin:
    """Before the float layer class in the bases: its `row_paths()` gains "q8" (the subclass's `_path_q8`)."""

    q8_only_rows = 16  # up to this many rows the 8-bit inputs' kernels always run (decode); beyond, they are timed
    q8_input_block = 32  # inputs per 8-bit scale (llama.cpp's Q8 block)

    def row_paths(self) -> dict[str, int | None]:
        paths = super().row_paths()
        if cpu_ops() is not None:
            paths["q8"] = None
        return paths

    def candidate_paths(self, rows, paths):
        """Only the 8-bit inputs' kernels at decode sizes (a float path there would compute other numbers, not only
        round in another order); every path beyond."""
        if "q8" in paths and rows <= self.q8_only_rows:
            return [name for name in Q8_PATHS if name in paths]
        return super().candidate_paths(rows, paths)

    def default_path(self, rows: int) -> str:
        """The 8-bit inputs' kernel up to q8_only_rows rows, as asked; the float layer's choice beyond (the fixed
        plan)."""
        if cpu_ops() is not None and rows <= self.q8_only_rows:
            return "q8"
        return super().default_path(rows)
