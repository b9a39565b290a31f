"""Request bodies of the OpenAI API subset the server implements, validated with pydantic. Fields other clients
send and we do not use are accepted and ignored (as vLLM does); a known field of the wrong type or out of range
is a 400 that names it."""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from llmopt.runtime.engine.sampling import MAX_LOGPROBS


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, description="llmopt extension (as vLLM's): 0 = off")
    n: int = Field(1, ge=1, le=16)
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: bool = False  # extension used by benchmarks (vLLM has it too)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = Field(16, ge=0)  # the OpenAI API's default; 0 only with echo (scoring)
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False  # the prompt's text (and with logprobs its tokens' log-probabilities) before the output


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[str, list[dict], None] = None

    def text(self) -> str:
        """The message's text (content parts of type text joined; other parts are not supported)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.get("text", "") for part in self.content if part.get("type") == "text")


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    max_completion_tokens: Optional[int] = Field(None, ge=1)


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error",
               code: str | None = None) -> dict:
    """The OpenAI API's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
