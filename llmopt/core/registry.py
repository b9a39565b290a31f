"""A small name -> object registry, so methods, stages and formats are added by adding a file."""

from __future__ import annotations

import functools
import importlib
import pkgutil
from typing import Callable, Generic, Iterator, TypeVar

from llmopt.core.errors import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names to objects. `what` names the kind of thing, for error messages.

    >>> methods = Registry("quantization method")
    >>> @methods.register("rtn")
    ... class RTN: ...
    >>> methods.get("rtn") is RTN
    True
    """

    def __init__(self, what: str):
        self.what = what
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def decorator(obj: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.what} {name!r} registered twice")
            self._items[name] = obj
            return obj

        return decorator

    def add(self, name: str, obj: T) -> T:
        return self.register(name)(obj)

    def remove(self, name: str) -> T:
        """Unregister `name` (a test's plug-in, once the test is done)."""
        return self._items.pop(name)

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            raise ConfigError(
                f"unknown {self.what} {name!r}: choose one of {', '.join(sorted(self._items))}"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())


def declared_names(package: str, registry: str) -> list[str]:
    """The names a package's modules add to `registry` (`REGISTRY.add("name", ...)` or
    `@REGISTRY.register("name")` with a literal name), read from their source without importing them: the CLI
    lists a registry's choices in --help without importing torch. tests/cli/test_options_match_configs.py checks
    the lists equal the registries once imported."""
    return sorted(_declarations(package).get(registry, []))


@functools.lru_cache(maxsize=None)
def _declarations(package: str) -> dict[str, list[str]]:
    """registry name -> the literal names the package's modules add to it; each file read once per process, and
    parsed only if it names a registry call at all (the CLI pays this at every start)."""
    import ast
    from importlib.util import find_spec
    from pathlib import Path

    found: dict[str, list[str]] = {}
    for path in sorted(Path(find_spec(package).origin).parent.glob("*.py")):
        text = path.read_text()
        if ".add(" not in text and ".register(" not in text:
            continue
        for node in ast.walk(ast.parse(text)):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("add", "register") and isinstance(node.func.value, ast.Name)
                    and node.args and isinstance(node.args[0], ast.Constant)):
                found.setdefault(node.func.value.id, []).append(node.args[0].value)
    return found


def import_submodules(package: str) -> list[str]:
    """Import every module of `package` (not its sub-packages' modules), so that each registers what it defines:
    adding a method, format, linear method, attention backend or model family is adding a module. Returns the
    modules' names."""
    root = importlib.import_module(package)
    names = [f"{package}.{info.name}" for info in pkgutil.iter_modules(root.__path__) if not info.name.startswith("_")]
    for name in names:
        importlib.import_module(name)
    return names
