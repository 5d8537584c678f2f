"""Request bodies of the OpenAI-compatible routes. Unknown fields are refused (400 naming the field)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Self

import orjson
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from gateway.api.bounds import INTEGRAL, Budget, Count, IntegralItems, Seed, TopK, TopLogprobs
from gateway.session.identity import SESSION_ID_PATTERN
from gateway.tokenization.token_ids import TokenId


def _storable(value: Any) -> Any:
    """Refuse what the trajectory store cannot encode as JSON (orjson): integers beyond 64 bits."""
    try:
        orjson.dumps(value)
    except TypeError as exc:
        raise ValueError(f"not storable as JSON: {exc}") from None
    return value


MAX_METADATA_BYTES = 16 * 1024
"""The most a request's metadata may take as JSON: it is kept with the session for `store.ttl_s` (5 bodies of
10 MiB each once held 84 MB of Redis for a day)."""


def _bounded(value: Any) -> Any:
    """Refuse metadata over `MAX_METADATA_BYTES` as JSON, or that the store cannot encode (`_storable`)."""
    _storable(value)
    if value is not None and len(orjson.dumps(value)) > MAX_METADATA_BYTES:
        raise ValueError(f"metadata takes more than {MAX_METADATA_BYTES} bytes as JSON")
    return value


Metadata = Annotated[dict[str, Any], AfterValidator(_bounded)]
"""Session metadata (`POST /v1/sessions`, a finish): JSON values, at most `MAX_METADATA_BYTES`."""

TextMetadata = Annotated[dict[str, str], AfterValidator(_bounded)]
"""A turn's OpenAI-style metadata (str → str), at most `MAX_METADATA_BYTES`."""


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class FunctionDefinition(_Body):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: Annotated[dict[str, Any] | None, AfterValidator(_storable)] = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _json_schema_object(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and value.get("type", "object") != "object":
            raise ValueError("function parameters must be a JSON schema of type object")
        return value


class ToolDefinition(_Body):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"] = "function"
    function: NamedFunction


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    name: str
    arguments: Annotated[str | dict[str, Any], AfterValidator(_storable)] = "{}"


class ToolCallMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


_NEEDS_CONTENT: dict[str, Any] = {
    # What `_content_where_needed` checks, said in the schema: content for every role but the assistant's, and a
    # tool message's tool_call_id.
    "allOf": [
        {
            "if": {"properties": {"role": {"enum": ["system", "developer", "user", "tool"]}}},
            "then": {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
        },
        {
            "if": {"properties": {"role": {"const": "tool"}}},
            "then": {"required": ["tool_call_id"], "properties": {"tool_call_id": {"type": "string", "minLength": 1}}},
        },
    ]
}


class ChatMessage(BaseModel):
    """One message. Extra keys clients echo back (`refusal`, `annotations`, ...) are accepted and dropped."""

    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra=_NEEDS_CONTENT)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str | list[dict[str, Any]] | None, AfterValidator(_storable)] = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None
    tool_call_id: str | None = None
    # An assistant reply's reasoning as the gateway answered it (`reasoning` is vLLM's newer name for it).
    reasoning_content: str | None = None
    reasoning: str | None = None

    @model_validator(mode="after")
    def _content_where_needed(self) -> ChatMessage:
        if self.role in ("system", "developer", "user", "tool") and self.content is None:
            raise ValueError(f"a {self.role} message needs content")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id")
        return self

    def to_template(self) -> dict[str, Any]:
        """The message as the chat template sees it (OpenAI field names, no client-only extras)."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.content}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": c.function.arguments},
                }
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        reasoning = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if reasoning is not None and self.role == "assistant":
            out["reasoning_content"] = reasoning
        return out


Stop = str | Annotated[list[str], Field(max_length=8)] | None


class Sampled(_Body):
    """What chat and completion requests share: the model, how to sample, the session."""

    model: str = Field(min_length=1)
    max_tokens: Budget | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: TopK | None = None
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: Seed | None = None
    stop: Stop = None
    stop_token_ids: list[Count] | None = Field(None, max_length=1024)
    n: Annotated[int, Field(ge=1, le=64), INTEGRAL] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: Count = 0
    user: str | None = Field(None, max_length=256)
    session_id: str | None = Field(None, pattern=SESSION_ID_PATTERN)
    # Sent to the engine when set (both engines apply them; the simulator logs and ignores them).
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    # OpenAI's metadata reaches the session (`gateway.turns.runner`: set on the turn that creates it, new keys added
    # later, a changed value refused).
    metadata: TextMetadata | None = None
    store: bool | None = None
    # Vendor field: the n choices become the first turns of n new sessions `<session>-<i>` of one GRPO group, each
    # finished with its own reward (`gateway.turns.group`).
    group: bool = False

    @property
    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return [s for s in stops if s]


class ChatSettings(Sampled):
    """A chat request but its conversation: what a chat turn samples with, and its tools."""

    max_completion_tokens: Budget | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    tools: list[ToolDefinition] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's: extra arguments of the chat template (`{"enable_thinking": false}`), over `model.chat_template_kwargs`.
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's, as vLLM renders it: the template gets `reasoning_effort`, and `enable_thinking` (not "none") unless
    # `chat_template_kwargs` sets it.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None

    @property
    def budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @model_validator(mode="after")
    def _coherent(self) -> Self:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if isinstance(self.tool_choice, NamedToolChoice) and not any(
            t.function.name == self.tool_choice.function.name for t in self.tools or []
        ):
            raise ValueError(f"tool_choice names {self.tool_choice.function.name!r}, which is not in tools")
        return self


class ChatCompletionRequest(ChatSettings):
    messages: list[ChatMessage] = Field(min_length=1)


class CompletionRequest(Sampled):
    # Ids checked against the vocabulary by the route. Each branch bounded apart: a length on the union would say
    # `minLength` in the schema, which holds strings only. Integral floats as ids around the union (`IntegralItems`),
    # which keeps the branches' names in errors.
    prompt: Annotated[
        Annotated[str, Field(min_length=1)] | Annotated[list[TokenId], Field(min_length=1)], IntegralItems()
    ]
    logprobs: TopLogprobs | None = None
    echo: bool = False
    suffix: None = None


class SessionCreate(_Body):
    model: str | None = Field(None, min_length=1, description="The pool's model (`pools:`); none: the only pool.")
    metadata: Metadata = Field(default_factory=dict)
    session_id: str | None = Field(None, pattern=SESSION_ID_PATTERN)


class SessionFinish(_Body):
    reward: float | None = Field(None, allow_inf_nan=False)
    # One reward per sample of the session, in sample index order (`rollout.choices[].sample_index`).
    rewards: list[Annotated[float, Field(allow_inf_nan=False)]] | None = Field(None, max_length=100_000)
    metadata: Metadata | None = None
