"""The package's layering (docs/design.md, "Layers"): every module's imports, read with `ast`, must point down
or sideways within its layer, and no set of modules may import each other in a cycle."""

import ast
import inspect
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "llmopt"
# lowest first; packages on one line share a layer and must not import each other
LAYERS = [
    ("core",),
    ("compress", "distill"),
    ("formats",),
    ("runtime",),
    ("jobs",),
    ("serve",),
    ("eval",),
    ("recipe", "report", "planner"),
    ("cli",),
]
RANK = {package: rank for rank, layer in enumerate(LAYERS) for package in layer}
# The engine half of the runtime never touches tensors; only the Engine itself reaches the executor.
TENSOR_FREE = "llmopt.runtime.engine"
ENGINE_MODULE = "llmopt.runtime.engine.engine"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every llmopt module a file imports, at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return {name for name in found if name == "llmopt" or name.startswith("llmopt.")}


def modules() -> dict[str, set[str]]:
    graph = {module_name(p): imports_of(p) for p in PACKAGE.rglob("*.py")}
    # keep only names that are modules (`from pkg import name` may name a function)
    return {m: {i for i in deps if i in graph and i != m} for m, deps in graph.items()}


def top_package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_every_package_has_a_layer():
    packages = {top_package(m) for m in modules()} - {None, "__main__"}
    assert packages <= set(RANK), f"put {sorted(packages - set(RANK))} into LAYERS and docs/design.md"


def test_no_import_points_upward_or_across_a_layer():
    bad = []
    for module, deps in modules().items():
        here = top_package(module)
        if here not in RANK:
            continue
        for dep in deps:
            there = top_package(dep)
            if there is None or there == here:
                continue
            if RANK[there] >= RANK[here]:
                bad.append(f"{module} -> {dep}")
    assert not bad, "imports against the layer order:\n" + "\n".join(sorted(bad))


def test_the_engine_half_of_the_runtime_touches_no_tensors():
    bad = []
    for path in (PACKAGE / "runtime" / "engine").rglob("*.py"):
        module = module_name(path)
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            for name in names:
                if name.split(".")[0] in ("torch", "numpy", "triton"):
                    bad.append(f"{module} imports {name}")
                if name.startswith("llmopt.runtime.executor") and module != ENGINE_MODULE:
                    bad.append(f"{module} imports {name}")
    assert not bad, "\n".join(bad)


# Inside the runtime, lowest first: the kernels, the distributed pieces the models are built on (process groups,
# sharding plans, pipeline stages), the rest of the executor, speculative decoding, then the fronts above the
# Engine. (The tensor-free engine is checked below: only its Engine reaches the executor.)
RUNTIME_LAYERS = ["executor.kernels", "distributed", "executor", "spec_decode", "fronts"]


def runtime_layer(module: str) -> int | None:
    """The rank in RUNTIME_LAYERS of a runtime module (its longest matching prefix), None outside them."""
    for rank, name in sorted(enumerate(RUNTIME_LAYERS), key=lambda item: -len(item[1])):
        prefix = f"llmopt.runtime.{name}"
        if module == prefix or module.startswith(prefix + "."):
            return rank
    return None


def test_inside_the_runtime_no_import_points_upward():
    bad = []
    for module, deps in modules().items():
        here = runtime_layer(module)
        if here is None:
            continue
        for dep in deps:
            there = runtime_layer(dep)
            if there is not None and there > here:
                bad.append(f"{module} -> {dep}")
    assert not bad, "imports against the runtime's layer order:\n" + "\n".join(sorted(bad))


def test_every_engine_front_is_an_engine_client():
    """The one-process Engine and each multi-process front have every member of the written protocol."""
    from llmopt.runtime.engine.client import EngineClient
    from llmopt.runtime.engine.engine import Engine
    from llmopt.runtime.fronts.data_parallel import DataParallelEngine
    from llmopt.runtime.fronts.disaggregated import DisaggregatedEngine

    members = [m for m in dir(EngineClient) if not m.startswith("_")]
    attributes = list(EngineClient.__annotations__)
    for front in (Engine, DataParallelEngine, DisaggregatedEngine):
        missing = [m for m in members if not hasattr(front, m)]
        sources = "".join(inspect.getsource(c) for c in front.__mro__ if c.__module__.startswith("llmopt."))
        missing += [a for a in attributes if not re.search(rf"self\.{a}\b[\w\s,.]*=", sources)]
        assert not missing, f"{front.__name__} lacks {missing}"


def test_no_import_cycles():
    graph = modules()
    state: dict[str, int] = {}  # 1 visiting, 2 done
    cycles = []

    def visit(module: str, stack: list[str]) -> None:
        state[module] = 1
        for dep in sorted(graph[module]):
            if state.get(dep) == 1:
                cycles.append(" -> ".join(stack[stack.index(dep):] + [module, dep]) if dep in stack else
                              f"{module} -> {dep}")
            elif dep not in state:
                visit(dep, stack + [module])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


@pytest.mark.parametrize("module, dep", [("llmopt.core.models", "llmopt.formats.read"),
                                         ("llmopt.formats.read", "llmopt.runtime.executor.linear")])
def test_the_check_would_catch_an_upward_import(module, dep):
    assert RANK[top_package(dep)] >= RANK[top_package(module)]


def test_the_readme_layout_lists_the_packages_in_layer_order():
    import re

    readme = (PACKAGE.parent / "README.md").read_text()
    layout = readme[readme.index("## Layout"):]
    block = layout[layout.index("```") + 3:]
    block = block[:block.index("```")]
    listed = [m.group(1) for m in re.finditer(r"llmopt/(\w+)/", block)]
    assert listed == [package for layer in LAYERS for package in layer]
