"""Request body of the OpenAI Responses API (`POST /v1/responses`). Unknown fields are refused (400 naming the field),
and so are the parts of the API this gateway does not serve: image, file and audio inputs, built-in tools (web search,
file search, computer use, ...), structured output formats, background runs, server-side conversations and stored
prompts.

Accepted and ignored, because the official SDKs and the openai-agents SDK send them and ignoring them changes no
sampled token: `include` (the agents SDK sends `[]`; nothing here is encrypted or has extra outputs to include),
`reasoning.summary` (the model's template decides how it reasons; `reasoning.effort` reaches the template as vLLM
gives it, with `chat_template_kwargs`: `gateway.turns.request.template_kwargs_of`), `truncation` (never truncated: a
prompt past the context length is a 400), `prompt_cache_key`, `prompt_cache_retention`, `safety_identifier`,
`service_tier`, `stream_options`, `text.verbosity`; and on echoed output items the fields the client got with them
(`id`, `status`, `annotations`, `logprobs`, `encrypted_content`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    model_validator,
)

from gateway.api.bounds import Budget, Count, Seed, TopK
from gateway.api.openai.models import Stop, TextMetadata, _storable


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def _kind(default: str | None) -> Any:
    """A discriminator on `type` (`default` where an item may leave it out: an input message)."""

    def kind(value: Any) -> str | None:
        if isinstance(value, dict):
            found = value.get("type", default)
            return found if isinstance(found, str) else None
        return getattr(value, "type", None)

    return kind


class TextPart(_Body):
    """Text of a message: the client's (`input_text`) or the model's, echoed back (`output_text`)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


def _parts(value: Any) -> Any:
    """A string content is one text part (the union `str | parts` would name both in every error)."""
    return [{"type": "input_text", "text": value}] if isinstance(value, str) else value


TextParts = Annotated[
    list[
        Annotated[
            Annotated[TextPart, Tag("input_text")] | Annotated[TextPart, Tag("output_text")],
            Discriminator(
                _kind(None),
                custom_error_type="unsupported_content",
                custom_error_message="only text content is served here (input_text, output_text): no images, files "
                "or audio",
            ),
        ]
    ],
    Field(max_length=1024),
    BeforeValidator(_parts),
]


class MessageItem(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: TextParts
    id: str | None = None
    status: str | None = None
    phase: str | None = None


class FunctionCallItem(_Body):
    """A function call the model made, echoed back: the assistant message's `tool_calls` entry `call_id`."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Body):
    """A function's result: a `tool` message answering `call_id`."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: TextParts
    id: str | None = None
    status: str | None = None


class SummaryText(_Body):
    type: Literal["summary_text"]
    text: str


class ReasoningText(_Body):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(_Body):
    """The model's reasoning, echoed back: the next assistant message's `reasoning_content` (its `content`; a
    summary alone is not the reasoning the model sampled, and is not used)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[SummaryText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: str | None = None


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(
        _kind("message"),
        custom_error_type="unsupported_item",
        custom_error_message="input items served here: message, function_call, function_call_output, reasoning",
    ),
]


class FunctionTool(_Body):
    """A function the model may call. Built-in tools (web_search, file_search, ...) are not served."""

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: Annotated[dict[str, Any] | None, AfterValidator(_storable)] = None
    strict: bool | None = None

    def definition(self) -> dict[str, Any]:
        """The chat template's function definition of this tool."""
        return self.model_dump(exclude={"type"}, exclude_none=True)

    def echoed(self) -> dict[str, Any]:
        """The tool as a response lists it."""
        return {
            "type": "function",
            "name": self.name,
            "description": self.description,
            "parameters": self.parameters,
            "strict": self.strict if self.strict is not None else True,
        }


Tools = Annotated[
    list[
        Annotated[
            Annotated[FunctionTool, Tag("function")],
            Discriminator(
                _kind(None),
                custom_error_type="unsupported_tool",
                custom_error_message="only function tools are served here: no built-in tools",
            ),
        ]
    ],
    Field(max_length=128),
]


class NamedFunction(_Body):
    type: Literal["function"]
    name: str


class TextFormat(_Body):
    type: Literal["text"]


class TextConfig(_Body):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(_Body):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


def _one_message(value: Any) -> Any:
    """A string input is one user message."""
    return [{"type": "message", "role": "user", "content": value}] if isinstance(value, str) else value


class ResponseRequest(_Body):
    model: str = Field(min_length=1)
    input: Annotated[list[InputItem], Field(max_length=100_000), BeforeValidator(_one_message)] = Field(
        default_factory=list
    )
    instructions: str | None = None
    tools: Tools | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: Budget | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    previous_response_id: str | None = Field(None, min_length=1, max_length=256)
    store: bool | None = None
    metadata: TextMetadata | None = Field(None, max_length=16)
    text: TextConfig | None = None
    user: str | None = Field(None, max_length=256)
    background: Literal[False] | None = None
    # `effort` reaches the chat template (see the module docstring); the rest is accepted and ignored.
    reasoning: ReasoningConfig | None = None
    # vLLM's: extra arguments of the chat template, over `model.chat_template_kwargs`.
    chat_template_kwargs: dict[str, Any] | None = None
    # Accepted and ignored (see the module docstring).
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    stream_options: dict[str, Any] | None = None
    # The gateway's vendor fields, as on the chat API (`ChatCompletionRequest`).
    session_id: str | None = Field(None, min_length=1, max_length=256)
    seed: Seed | None = None
    top_k: TopK | None = None
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    stop: Stop = None
    stop_token_ids: list[Count] | None = Field(None, max_length=1024)
    ignore_eos: bool = False
    min_tokens: Count = 0

    @model_validator(mode="after")
    def _coherent(self) -> ResponseRequest:
        if isinstance(self.tool_choice, NamedFunction) and not any(
            t.name == self.tool_choice.name for t in self.tools or []
        ):
            raise ValueError(f"tool_choice names {self.tool_choice.name!r}, which is not in tools")
        return self
