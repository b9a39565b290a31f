"""The one exception family library code raises for user-facing problems.

Every message says what went wrong *and what to do*; the CLI prints it as one red line and exits 1.
"""


class LLMOptError(Exception):
    """Base class: a problem the user can fix. The message is shown as-is."""

    param: str | None = None  # the setting at fault, where one is (ConfigError sets it)


class ModelNotFoundError(LLMOptError):
    """A MODEL argument resolved to nothing loadable."""


class ModelLoadError(LLMOptError):
    """A model was found but could not be read (corrupt file, unsupported family...)."""


class UnsupportedArchitectureError(LLMOptError):
    """The model family is not in the architecture adapter table."""


class DatasetError(LLMOptError):
    """A dataset name or file could not be resolved or read."""


class ConfigError(LLMOptError):
    """Invalid settings (bad option value, conflicting options, bad recipe). `param` names the setting when one
    is at fault (the HTTP server reports it as the error's `param`)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ParallelError(LLMOptError):
    """A rank of a parallel engine failed or stopped answering: the engine cannot go on (the message names the
    rank and the cause)."""


class ReplicaFailed(LLMOptError):
    """The data-parallel replica running a request died: the request is lost (the replica restarts; the others go
    on)."""


class RequestsFailed(LLMOptError):
    """Some requests of a multi-replica engine failed on their own (`errors`: request id -> its error); the
    engine and its other requests go on."""

    def __init__(self, errors: dict):
        super().__init__("; ".join(sorted({str(e) for e in errors.values()})))
        self.errors = errors


class ArtifactError(LLMOptError):
    """An output artifact cannot be written or read (exists, incomplete, wrong format)."""


def invalid_settings(error, what: str) -> ConfigError:
    """One ConfigError line for a pydantic ValidationError of `what`'s settings: the first problem and where."""
    first = error.errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    message = first["msg"].removeprefix("Value error, ")
    return ConfigError(f"invalid {what} setting{' ' + where if where else ''}: {message}")


def file_problem(error, keys, required) -> str:
    """The first problem of a settings file a pydantic model validated, naming its key: an unknown key lists the
    accepted `keys`, a missing one the `required` ones; else the key, the problem and the value given."""
    first = error.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "the file"
    if first["type"] == "extra_forbidden":
        return f"unknown key {where!r}: the keys are {', '.join(keys)}"
    if first["type"] == "missing":
        return f"{where} is missing (required: {', '.join(required)})"
    return f"{where}: {first['msg'].removeprefix('Value error, ')} (got {first.get('input')!r})"
