"""Request bodies of the OpenAI API subset the server implements, validated with pydantic before anything reaches
the engine. As OpenAI's own API does, a field the server does not know is a 400 naming it (a misspelt `max_token`
is never silently ignored). Fields that OpenAI clients, vLLM clients and lm-evaluation-harness send are known:
those the server implements act; the others (`NEUTRAL_FIELDS`) are accepted at the value that changes nothing
(`repetition_penalty: 1.0`, `logit_bias: {}`, ...) and any other value is a 400 saying the server does not
support it. A field of the wrong type or out of range is a 400 naming it."""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator, model_validator

from llmopt.runtime.engine.sampling import MAX_LOGPROBS, MAX_SEED, MIN_SEED

DEFAULT_MAX_BODY_BYTES = 16 * 2 ** 20  # far above any prompt a context holds (a 32k-token id list is ~250 KB)

# field -> the values it is accepted at (none of them changes the output); any other value is a 400.
# Shared by both endpoints unless listed in CHAT_ONLY_NEUTRAL / COMPLETION_ONLY_NEUTRAL.
NEUTRAL_FIELDS: dict[str, tuple] = {
    # OpenAI's
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "logit_bias": (None, {}),
    # vLLM's sampling extensions
    "use_beam_search": (False,),
    "min_p": (0,),
    "repetition_penalty": (1,),
    "length_penalty": (1,),
    "min_tokens": (0,),
    "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "truncate_prompt_tokens": (None,),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "prompt_logprobs": (None,),
    "return_tokens_as_token_ids": (False,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "structured_outputs": (None,),
    "logits_processors": (None,),
    "priority": (0,),
    "response_format": (None, {"type": "text"}),
}
COMPLETION_ONLY_NEUTRAL: dict[str, tuple] = {"suffix": (None, "")}
CHAT_ONLY_NEUTRAL: dict[str, tuple] = {
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),  # with no tools, "auto" chooses none
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "echo": (False,),  # vLLM's chat echo (the last message's text before the reply)
    "add_generation_prompt": (True,),
    "continue_final_message": (False,),
    "chat_template": (None,),
    "chat_template_kwargs": (None, {}),
    "documents": (None,),
}
# metadata a client may send that has no effect on what is generated (any value accepted)
METADATA_FIELDS = ("user", "metadata", "store", "service_tier", "request_id", "parallel_tool_calls",
                   "web_search_options")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool = False
    # vLLM's: usage in every chunk, not implemented (reported once, at the end)
    continuous_usage_stats: StrictBool = False

    @field_validator("continuous_usage_stats")
    @classmethod
    def _usage_once(cls, value: bool) -> bool:
        if value:
            raise UnsupportedValue("stream_options.continuous_usage_stats", (False,))
        return value


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")  # unknown keys are refused first, in `check_fields`

    model: Optional[str] = None
    max_tokens: Optional[StrictInt] = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: StrictInt = Field(0, ge=-1, description="vLLM's extension: 0 or -1 = off")
    n: StrictInt = Field(1, ge=1, le=16)
    seed: Optional[StrictInt] = Field(None, ge=MIN_SEED, le=MAX_SEED)
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[StrictInt]] = None  # vLLM's extension: token ids that end the output
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: StrictBool = False  # vLLM's extension (benchmarks use it)

    @model_validator(mode="before")
    @classmethod
    def check_fields(cls, data: Any) -> Any:
        """Unknown fields, and known ones at a value the server does not implement, are refused by name."""
        if not isinstance(data, dict):
            return data
        declared = set(cls.model_fields)
        for name, value in data.items():
            if name in declared or name in METADATA_FIELDS:
                continue
            allowed = cls.neutral().get(name)
            if allowed is None:
                raise UnknownField(name)
            if value not in allowed:
                raise UnsupportedValue(name, allowed)
        return {k: v for k, v in data.items() if k in declared}

    @classmethod
    def neutral(cls) -> dict[str, tuple]:
        return NEUTRAL_FIELDS

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class UnknownField(ValueError):
    """A body field this server does not know (OpenAI answers these with a 400 too)."""

    def __init__(self, name: str):
        super().__init__(f"unrecognized request argument supplied: {name}")
        self.param = name


class UnsupportedValue(ValueError):
    """A known field at a value the server does not implement."""

    def __init__(self, name: str, allowed: tuple):
        shown = " or ".join(repr(v) for v in allowed)
        super().__init__(f"{name} is not supported by this server: leave it out (or at {shown})")
        self.param = name


class CompletionRequest(SamplingFields):
    # (strict ints: JSON's true / false are not token ids 1 / 0)
    prompt: Union[str, list[str], list[StrictInt], list[list[StrictInt]]]
    max_tokens: Optional[StrictInt] = Field(16, ge=0)  # the OpenAI API's default; 0 only with echo (scoring)
    logprobs: Optional[StrictInt] = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: StrictBool = False  # the prompt's text (and with logprobs its tokens' log-probabilities) before the output
    best_of: Optional[StrictInt] = Field(None, ge=1)  # only equal to n (no candidates beyond the choices returned)
    add_special_tokens: StrictBool = True  # vLLM's extension: the tokenizer's BOS etc. before a text prompt

    @classmethod
    def neutral(cls) -> dict[str, tuple]:
        return {**NEUTRAL_FIELDS, **COMPLETION_ONLY_NEUTRAL}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[str, list[dict], None] = None
    # passed on to the chat template (which may use or ignore them)
    name: Optional[str] = None
    tool_calls: Optional[list[dict]] = None
    tool_call_id: Optional[str] = None
    refusal: Optional[str] = None

    def template_fields(self) -> dict:
        """What the chat template gets: role, the text, and the optional fields the client set."""
        extra = {k: getattr(self, k) for k in ("name", "tool_calls", "tool_call_id") if getattr(self, k) is not None}
        return {"role": self.role, "content": self.text(), **extra}

    def unsupported_part(self) -> str | None:
        """The type of the first content part that is not text (images, audio, files), if any."""
        if isinstance(self.content, list):
            for part in self.content:
                if part.get("type") != "text":
                    return str(part.get("type"))
        return None

    def text(self) -> str:
        """The message's text (content parts of type text joined; other parts are not supported)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.get("text", "") for part in self.content if part.get("type") == "text")


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: StrictBool = False
    top_logprobs: Optional[StrictInt] = Field(None, ge=0, le=MAX_LOGPROBS)
    max_completion_tokens: Optional[StrictInt] = Field(None, ge=1)
    add_special_tokens: StrictBool = False  # vLLM's extension: the chat template already places the special tokens

    @classmethod
    def neutral(cls) -> dict[str, tuple]:
        return {**NEUTRAL_FIELDS, **CHAT_ONLY_NEUTRAL}


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error",
               code: str | None = None) -> dict:
    """The OpenAI API's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def compile_chat_template(text: str) -> str | None:
    """Why this Jinja chat template does not compile (its line and the parser's message), else None: compiled as
    transformers compiles a tokenizer's template (its sandbox and extensions), or by a sandboxed Jinja with loop
    controls where that helper is not importable."""
    import jinja2

    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template as compile_template
    except ImportError:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def compile_template(source: str):
            return ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).from_string(source)
    try:
        compile_template(text)
    except jinja2.TemplateSyntaxError as e:
        return f"Jinja syntax error on line {e.lineno}: {e.message}"
    return None


def lone_surrogate_path(data: Any) -> str | None:
    """The JSON path (`messages.0.content`) of the first string holding a lone UTF-16 surrogate (JSON's "\\ud800"
    decodes to one; no tokenizer can encode it), else None. Iterative: a body's depth is bounded by the parser."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return path or "body"
        elif isinstance(value, dict):
            stack.extend((f"{path}.{k}" if path else str(k), v) for k, v in reversed(value.items()))
        elif isinstance(value, list):
            stack.extend((f"{path}.{i}" if path else str(i), v) for i, v in reversed(list(enumerate(value))))
    return None
