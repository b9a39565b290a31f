import pytest

from llmopt.core.errors import ConfigError
from llmopt.core.registry import Registry


def test_registry_lookup_and_unknown_name_lists_choices():
    reg = Registry("widget")
    reg.add("b", 2)

    @reg.register("a")
    def a():
        return 1

    assert reg.get("a") is a and reg.get("b") == 2 and reg.names() == ["a", "b"] and "a" in reg
    with pytest.raises(ConfigError, match="unknown widget 'c': choose one of a, b"):
        reg.get("c")
    with pytest.raises(ValueError):
        reg.add("a", 3)
