"""Request bodies of the Anthropic Messages routes (`POST /v1/messages`, `/v1/messages/count_tokens`).

Unknown fields are refused (400 naming the field), except those the official SDKs and agents built on them send that
change nothing a text-only model served here could honour, which are accepted and ignored:

- `cache_control` (prompt caching hints) on the request, system and content blocks, tools;
- `citations` on text blocks, `caller` and `toolset_name` on echoed `tool_use` blocks;
- `service_tier` on the request; `strict`, `eager_input_streaming` and `type: "custom"` on a tool;
- `disable_parallel_tool_use` in `tool_choice` (the model may still make several calls).

Image and document blocks, and server tools (a `type` other than `custom`), are refused with a 400 saying why.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from gateway.api.bounds import Budget, Seed, TopK
from gateway.api.openai.models import _storable
from gateway.session.identity import SESSION_ID_PATTERN

__all__ = [
    "Content",
    "ContentBlock",
    "CountTokensRequest",
    "MessageParam",
    "MessagesRequest",
    "RedactedThinkingBlock",
    "Text",
    "TextBlock",
    "ThinkingBlock",
    "ToolResultBlock",
    "ToolUseBlock",
]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Block(_Body):
    cache_control: dict[str, Any] | None = None  # a prompt-caching hint: ignored


class _UnsupportedBlock(BaseModel):
    """An image, document, ... block: refused with a clear message (the model served here reads text only)."""

    model_config = ConfigDict(extra="allow", strict=True)

    type: str

    @model_validator(mode="after")
    def _refuse(self) -> _UnsupportedBlock:
        raise ValueError(f"{self.type} content blocks are not supported: this gateway serves a text-only model")


_KNOWN = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")


def _block_type(value: Any) -> str:
    found = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return found if found in _KNOWN else "unsupported"


def _text_or_blocks(value: Any) -> str:
    return "text" if isinstance(value, str) else "blocks"


class TextBlock(_Block):
    type: Literal["text"]
    text: str
    citations: list[dict[str, Any]] | None = None  # ignored


TextOnly = Annotated[
    Annotated[TextBlock, Tag("text")] | Annotated[_UnsupportedBlock, Tag("unsupported")], Discriminator(_block_type)
]
Text = Annotated[Annotated[str, Tag("text")] | Annotated[list[TextOnly], Tag("blocks")], Discriminator(_text_or_blocks)]
"""A string or text blocks (a system prompt, a tool result); another block type is refused as unsupported."""


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    # Not `_storable`: it becomes the call's arguments text by the stdlib's encoder (`chat._assistant`), which
    # writes integers of any size, so the model's own call (an RL policy writes 2,000 digits) comes back in.
    input: dict[str, Any]
    caller: dict[str, Any] | None = None  # echoed from Anthropic's answers: ignored
    toolset_name: str | None = None


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: Text = ""
    # Accepted; the chat templates have no place for it, so the result reads as any other.
    is_error: bool = False
    toolset_name: str | None = None


class ThinkingBlock(_Body):
    type: Literal["thinking"]
    thinking: str
    signature: str = ""


class RedactedThinkingBlock(_Body):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[
    Annotated[TextBlock, Tag("text")]
    | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")]
    | Annotated[ThinkingBlock, Tag("thinking")]
    | Annotated[RedactedThinkingBlock, Tag("redacted_thinking")]
    | Annotated[_UnsupportedBlock, Tag("unsupported")],
    Discriminator(_block_type),
]
"""A content block chosen by its `type`; a type not served here is refused as unsupported."""

Content = Annotated[
    Annotated[str, Tag("text")] | Annotated[list[ContentBlock], Tag("blocks")], Discriminator(_text_or_blocks)
]


class MessageParam(_Body):
    """One message. Which blocks a role may hold (a user's text and tool results, an assistant's text, tool uses and
    thinking) is checked where the message becomes a chat message (`gateway.api.anthropic.chat`)."""

    role: Literal["user", "assistant"]
    content: Content


class Tool(_Body):
    """A client tool. Server tools (web search, code execution, ...: another `type`) are refused."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    input_schema: Annotated[dict[str, Any], AfterValidator(_storable)]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None
    strict: bool | None = None  # accepted; the arguments are not constrained
    eager_input_streaming: bool | None = None

    @field_validator("input_schema")
    @classmethod
    def _json_schema_object(cls, value: dict[str, Any]) -> dict[str, Any]:
        if value.get("type", "object") != "object":
            raise ValueError("a tool's input_schema must be a JSON schema of type object")
        return value

    @model_validator(mode="before")
    @classmethod
    def _client_tool(cls, value: Any) -> Any:
        kind = value.get("type") if isinstance(value, dict) else None
        if kind not in (None, "custom"):
            raise ValueError(f"server tools (type {kind!r}) are not supported: only client tools with input_schema")
        return value


class ToolChoice(_Body):
    """`auto` and `none` as Anthropic's; `any` and `tool` offer the tools without forcing a call (the gateway does
    not constrain decoding)."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None  # accepted; not enforced

    @model_validator(mode="after")
    def _named(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("tool_choice names a tool (`name`) exactly when its type is 'tool'")
        return self


class Metadata(_Body):
    user_id: str | None = Field(None, max_length=256)


class Thinking(_Body):
    """`disabled` reaches the chat template as vLLM gives it (`reasoning_effort` "none", `enable_thinking` off);
    `enabled` leaves the template's default (`budget_tokens` is not enforced: the model reasons as it samples)."""

    type: Literal["enabled", "disabled"]
    budget_tokens: Budget | None = None


class CountTokensRequest(_Body):
    """What `POST /v1/messages/count_tokens` counts: the prompt these would render to."""

    model: str = Field(min_length=1)
    messages: list[MessageParam] = Field(min_length=1)
    system: Text | None = None
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    cache_control: dict[str, Any] | None = None
    # vLLM's: extra arguments of the chat template, over `model.chat_template_kwargs`.
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _coherent(self) -> CountTokensRequest:
        choice = self.tool_choice
        if choice is not None and choice.name is not None and not any(t.name == choice.name for t in self.tools or []):
            raise ValueError(f"tool_choice names {choice.name!r}, which is not in tools")
        return self


class MessagesRequest(CountTokensRequest):
    """`POST /v1/messages`, plus the gateway's vendor fields (`session_id`, `seed`, `ignore_eos`)."""

    max_tokens: Budget
    stop_sequences: list[str] | None = Field(None, max_length=8)
    temperature: float = Field(1.0, ge=0.0, le=1.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: TopK | None = None
    stream: bool = False
    metadata: Metadata | None = None
    service_tier: str | None = None  # ignored
    session_id: str | None = Field(None, pattern=SESSION_ID_PATTERN)
    seed: Seed | None = None
    ignore_eos: bool = False
