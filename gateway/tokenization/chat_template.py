"""Chat messages in the shape chat templates expect, and the template applied to them.

Agents send OpenAI-style messages; templates follow transformers' convention. The differences handled here: content
given as a list of parts (text parts only; a text-only template cannot take others) and tool-call `arguments` sent as
a JSON string, which templates expect as an object (they `tojson` it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from jinja2 import TemplateError

from gateway.errors import InvalidRequest
from gateway.parsers.base import json_object

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

__all__ = ["RESERVED_TEMPLATE_ARGUMENTS", "Message", "Tool", "apply_chat_template", "reserved_in", "template_arguments"]

Message = Mapping[str, Any]
"""An OpenAI-style chat message: `role`, `content`, and for assistants `tool_calls`, for tools `tool_call_id`."""
Tool = Mapping[str, Any]
"""An OpenAI-style tool definition: `{"type": "function", "function": {"name", "description", "parameters"}}`."""


#: What the gateway itself passes to `apply_chat_template`, or what would change what it returns: never a template
#: argument of a request or of the config.
RESERVED_TEMPLATE_ARGUMENTS = frozenset(
    {
        "add_generation_prompt",
        "chat_template",
        "continue_final_message",
        "conversation",
        "documents",
        "max_length",
        "messages",
        "padding",
        "return_assistant_tokens_mask",
        "return_dict",
        "return_tensors",
        "sanitize_control_tokens",
        "tokenize",
        "tokenizer_kwargs",
        "tools",
        "truncation",
    }
)


def reserved_in(arguments: Mapping[str, Any]) -> str | None:
    """Why `arguments` cannot be template arguments (a reserved name among them), or None."""
    reserved = sorted(RESERVED_TEMPLATE_ARGUMENTS.intersection(arguments))
    return f"{', '.join(reserved)} cannot be a chat template argument: the gateway sets it" if reserved else None


def template_arguments(*layers: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The chat template's extra arguments: `layers` merged, a later one's keys over an earlier one's (the config's
    default, then the request's); None when there are none. A reserved name (`RESERVED_TEMPLATE_ARGUMENTS`) is an
    `InvalidRequest` naming `chat_template_kwargs`."""
    merged: dict[str, Any] = {}
    for layer in layers:
        if layer:
            merged.update(layer)
    refused = reserved_in(merged)
    if refused is not None:
        raise InvalidRequest(refused, param="chat_template_kwargs")
    return merged or None


def apply_chat_template(
    tokenizer: PreTrainedTokenizerFast,
    messages: Sequence[Message],
    tools: Sequence[Tool] | None,
    add_generation_prompt: bool,
    chat_template_kwargs: Mapping[str, Any] | None,
    *,
    tokenize: bool,
    sanitize_control_tokens: bool,
) -> object:
    """The template's text (`tokenize=False`) or ids of `messages`; a message or template the template rejects
    raises `InvalidRequest` naming `messages`. With `sanitize_control_tokens` (ids only) control tokens inside
    messages or tools are encoded as ordinary text."""
    conversation = [_template_message(i, message) for i, message in enumerate(messages)]
    try:
        return tokenizer.apply_chat_template(
            conversation,
            tools=[dict(tool) for tool in tools] if tools else None,
            add_generation_prompt=add_generation_prompt,
            tokenize=tokenize,
            return_dict=False,
            sanitize_control_tokens=sanitize_control_tokens and tokenize,
            **(chat_template_kwargs or {}),
        )
    except (TemplateError, ValueError, TypeError) as exc:  # the template rejects these messages
        raise InvalidRequest(f"the chat template cannot render these messages: {exc}", param="messages") from exc


def _template_message(index: int, message: Message) -> dict[str, Any]:
    """A copy of `message` in the shape chat templates expect (transformers' convention)."""
    out = dict(message)
    content = out.get("content")
    if isinstance(content, list):
        out["content"] = _text_of_parts(index, content)
    elif content is None and out.get("role") == "assistant":
        # A reply of tool calls only has no content (OpenAI's null); templates get "" as vLLM gives them: some
        # (Qwen3's) test `'</think>' in message.content` and cannot render a null.
        out["content"] = ""
    tool_calls = out.get("tool_calls")
    if isinstance(tool_calls, list):
        out["tool_calls"] = [_template_tool_call(call) for call in tool_calls]
    return out


def _text_of_parts(index: int, parts: list[Any]) -> str:
    """OpenAI content parts to one string; only text parts can be tokenized by a text-only template."""
    texts = []
    for part in parts:
        if not (isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            raise InvalidRequest("only text content parts are supported", param=f"messages[{index}].content")
        texts.append(part["text"])
    return "\n".join(texts)


def _template_tool_call(call: Any) -> Any:
    """Templates expect `arguments` as an object (they `tojson` it); the OpenAI API sends a JSON string."""
    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
        return call
    function = dict(call["function"])
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        parsed = json_object(arguments) if arguments.strip() else {}
        function["arguments"] = arguments if parsed is None else parsed  # not a JSON object: as the agent sent it
    return {**call, "function": function}
