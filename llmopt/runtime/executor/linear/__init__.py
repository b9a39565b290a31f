"""The runtime's linear methods (base.py says what one is); importing the package registers every module in it."""

from llmopt.core.registry import import_submodules
from llmopt.runtime.executor.linear.base import (  # noqa: F401
    LINEAR_METHODS, LinearMethod, make_linear, register_linear_method, select_linear_method,
)

import_submodules(__name__)

from llmopt.runtime.executor.linear.dense import fuse_linears  # noqa: E402, F401
