"""An Anthropic Messages request as the chat turn the gateway runs (`gateway.turns.request.TurnRequest`).

- `system` becomes the system message (text blocks joined by newlines, as content parts are: `chat_template`);
- an assistant's `thinking` blocks become its `reasoning_content`, its text blocks its content, its `tool_use` blocks
  its `tool_calls` (ids kept, `arguments` the JSON of `input`); `redacted_thinking` is opaque and left out;
- a user's `tool_result` blocks become `tool` messages in order (`tool_call_id` = `tool_use_id`), and its text
  blocks one user message after them;
- `tools` become function tools (`input_schema` as `parameters`); `tool_choice` `any` becomes `required` and
  `tool` a named choice, which, like OpenAI's, offer the tools without forcing a call;
- `metadata.user_id` names the session where nothing else does, as OpenAI's `user` does.

The reply the gateway answers converts back to exactly the assistant message the turn recorded
(`gateway.turns.prepared.assistant_message`), so an agent that echoes the answer extends the same sample.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from gateway.api.anthropic.models import (
    ContentBlock,
    CountTokensRequest,
    MessageParam,
    MessagesRequest,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from gateway.errors import InvalidRequest
from gateway.turns.request import Conversation, Sampling, TurnRequest, template_kwargs_of

__all__ = ["chat_messages", "chat_tools", "conversation", "messages_request"]


def messages_request(body: MessagesRequest, metadata: dict[str, str] | None = None) -> TurnRequest:
    """The chat turn `body` asks for; `metadata` the session's, as the route found it (`session_of`). The messages
    are built from the validated body in the template's form."""
    sampling = Sampling(
        max_tokens=body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        seed=body.seed,
        stop=tuple(stop for stop in body.stop_sequences or () if stop),
        ignore_eos=body.ignore_eos,
    )
    return TurnRequest(conversation(body), sampling, body.model, body.stream, metadata)


def conversation(body: CountTokensRequest) -> Conversation:
    """What the chat template renders of `body`: its messages, and its tools unless `tool_choice` is none."""
    choice = body.tool_choice
    offered = chat_tools(body) if choice is None or choice.type != "none" else None
    # Thinking turned off reaches the template as vLLM renders it: `reasoning_effort` "none", `enable_thinking` off.
    disabled = body.thinking is not None and body.thinking.type == "disabled"
    kwargs = template_kwargs_of(body.chat_template_kwargs, "none" if disabled else None)
    return Conversation(chat_messages(body), offered, kwargs)


def chat_messages(body: CountTokensRequest) -> list[dict[str, Any]]:
    """The conversation as OpenAI-style chat messages, in the template's form (`ChatMessage.to_template`'s)."""
    out: list[dict[str, Any]] = []
    if body.system is not None:
        out.append({"role": "system", "content": _text(body.system)})
    for index, message in enumerate(body.messages):
        if message.role == "user":
            out += _user(index, message)
        else:
            out.append(_assistant(index, message))
    if body.messages[-1].role == "assistant":
        raise InvalidRequest(
            "a final assistant message (a prefill) is not supported: end the conversation with a user message",
            param=f"messages[{len(body.messages) - 1}]",
        )
    return out


def chat_tools(body: CountTokensRequest) -> list[dict[str, Any]] | None:
    """The tools as the chat template's function tools (`input_schema` as `parameters`)."""
    if not body.tools:
        return None
    tools = []
    for tool in body.tools:
        function = {"name": tool.name, "description": tool.description, "parameters": tool.input_schema}
        if tool.description is None:
            del function["description"]
        tools.append({"type": "function", "function": function})
    return tools


def _text(content: str | Sequence[object]) -> str:
    """A string, or text blocks joined by newlines (other blocks never validate: `anthropic_models.Text`)."""
    if isinstance(content, str):
        return content
    return "\n".join(block.text for block in content if isinstance(block, TextBlock))


def _user(index: int, message: MessageParam) -> list[dict[str, Any]]:
    """A user message: its tool results as tool messages in order, then its text as one user message."""
    if isinstance(message.content, str):
        return [{"role": "user", "content": message.content}]
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for block in message.content:
        if isinstance(block, ToolResultBlock):
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": _text(block.content)})
        elif isinstance(block, TextBlock):
            texts.append(block.text)
        else:
            _misplaced(index, "user", block)
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _assistant(index: int, message: MessageParam) -> dict[str, Any]:
    """An assistant message: as `gateway.turns.prepared.assistant_message` records the gateway's own replies."""
    if isinstance(message.content, str):
        return {"role": "assistant", "content": message.content}
    texts: list[str] = []
    thinking: list[str] = []
    calls: list[dict[str, Any]] = []
    for block in message.content:
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ThinkingBlock):
            thinking.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            arguments = json.dumps(block.input, ensure_ascii=False)
            calls.append({"id": block.id, "type": "function", "function": {"name": block.name, "arguments": arguments}})
        elif not isinstance(block, RedactedThinkingBlock):
            _misplaced(index, "assistant", block)
    out: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts else None}
    if thinking:
        out["reasoning_content"] = "".join(thinking)
    if calls:
        out["tool_calls"] = calls
    return out


def _misplaced(index: int, role: str, block: ContentBlock) -> None:
    raise InvalidRequest(f"a {role} message cannot hold a {block.type} block", param=f"messages[{index}].content")
