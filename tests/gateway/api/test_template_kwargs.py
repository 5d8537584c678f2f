"""The chat template's extra arguments (`chat_template_kwargs`, `reasoning_effort`, `model.chat_template_kwargs`)
through a served gateway on real Redis: what the template renders with them is the prompt the engine gets and the
sample stores, a session's sample goes on only under the arguments it was rendered with, and a reserved name is a
400 that stores nothing. The template is this test's own: it names each argument it got in the system part, so a
conversation renders the same prefix turn after turn (its samples can extend)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.server import RunningGateway
from gateway.tokenization import ChatTokenizer
from tests.conftest import GatewayFactory, SimFactory
from tests.tokenizer_helpers import tokenizer_dir

TEMPLATE = (
    "{% if enable_thinking is defined and not enable_thinking %}<|im_start|>system\nthinking off<|im_end|>\n{% endif %}"
    "{% if reasoning_effort is defined %}<|im_start|>system\neffort {{ reasoning_effort }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content or '' }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


async def _served(
    tmp_path: Path, make_sim: SimFactory, make_gateway: GatewayFactory, **model: Any
) -> tuple[RunningGateway, ChatTokenizer]:
    folder = tokenizer_dir(tmp_path, config={"chat_template": TEMPLATE})
    gw = await make_gateway([await make_sim("vllm")], model={"tokenizer": str(folder), **model})
    return gw, ChatTokenizer.load(folder)


async def _chat(gw: RunningGateway, messages: list[dict[str, Any]], **extra: Any) -> httpx.Response:
    body = {"model": "tiny", "messages": messages, "max_tokens": 4, "ignore_eos": True, **extra}
    async with httpx.AsyncClient(timeout=30) as http:
        return await http.post(f"{gw.url}/v1/chat/completions", json=body)


async def _prompt_text(gw: RunningGateway, tokenizer: ChatTokenizer, session: str, index: int = 0) -> str:
    samples = await gw.services.store.load_samples(session)
    return tokenizer.decode(samples[index].prompt_ids.tolist())


HELLO = [{"role": "user", "content": "hello"}]


async def test_a_request_s_arguments_reach_the_template_over_the_config_s(
    tmp_path: Path, make_sim: SimFactory, make_gateway: GatewayFactory
) -> None:
    gw, tokenizer = await _served(tmp_path, make_sim, make_gateway, chat_template_kwargs={"enable_thinking": False})
    answer = await _chat(gw, HELLO, session_id="tk-default")
    assert answer.status_code == 200, answer.text
    assert (await _prompt_text(gw, tokenizer, "tk-default")).startswith("<|im_start|>system\nthinking off")
    answer = await _chat(gw, HELLO, session_id="tk-over", chat_template_kwargs={"enable_thinking": True})
    assert answer.status_code == 200, answer.text
    text = await _prompt_text(gw, tokenizer, "tk-over")
    assert "thinking off" not in text
    assert text == tokenizer.decode(tokenizer.render(HELLO, chat_template_kwargs={"enable_thinking": True}))
    [sample] = await gw.services.store.load_samples("tk-over")
    assert sample.chat_template_kwargs == {"enable_thinking": True}


async def test_reasoning_effort_is_rendered_as_vllm_renders_it(
    tmp_path: Path, make_sim: SimFactory, make_gateway: GatewayFactory
) -> None:
    """`reasoning_effort` reaches the template, and `enable_thinking` follows it unless the request sets it."""
    gw, tokenizer = await _served(tmp_path, make_sim, make_gateway)
    answer = await _chat(gw, HELLO, session_id="tk-none", reasoning_effort="none")
    assert answer.status_code == 200, answer.text
    text = await _prompt_text(gw, tokenizer, "tk-none")
    assert text.startswith("<|im_start|>system\nthinking off<|im_end|>\n<|im_start|>system\neffort none")
    answer = await _chat(
        gw, HELLO, session_id="tk-low", reasoning_effort="low", chat_template_kwargs={"enable_thinking": False}
    )
    assert answer.status_code == 200, answer.text
    assert "effort low" in (await _prompt_text(gw, tokenizer, "tk-low"))
    [sample] = await gw.services.store.load_samples("tk-low")
    assert sample.chat_template_kwargs == {"enable_thinking": False, "reasoning_effort": "low"}


async def test_a_session_s_sample_goes_on_only_under_the_arguments_it_was_rendered_with(
    tmp_path: Path, make_sim: SimFactory, make_gateway: GatewayFactory
) -> None:
    gw, tokenizer = await _served(tmp_path, make_sim, make_gateway)
    quiet = {"enable_thinking": False}
    first = await _chat(gw, HELLO, session_id="tk-turns", chat_template_kwargs=quiet)
    assert first.status_code == 200, first.text
    messages = [*HELLO, {"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]}]
    messages.append({"role": "user", "content": "and then?"})
    second = await _chat(gw, messages, session_id="tk-turns", chat_template_kwargs=quiet)
    assert second.status_code == 200, second.text
    [sample] = await gw.services.store.load_samples("tk-turns")
    assert sample.num_turns == 2  # the same arguments: the sample goes on
    # The conversation goes on, without the arguments: read without them, the sample's conversation is a prefix of
    # the new one, but its ids were rendered with them.
    messages += [
        {"role": "assistant", "content": second.json()["choices"][0]["message"]["content"]},
        {"role": "user", "content": "and now?"},
    ]
    third = await _chat(gw, messages, session_id="tk-turns")
    assert third.status_code == 200, third.text
    old, new = await gw.services.store.load_samples("tk-turns")
    assert new.chat_template_kwargs is None and new.prompt_ids.tolist() == tokenizer.render(messages)
    assert old.chat_template_kwargs == quiet and old.num_turns == 2


@pytest.mark.parametrize("arguments", [{"add_generation_prompt": False}, {"tools": []}, {"tokenize": False}])
async def test_an_argument_the_gateway_sets_is_a_400_that_stores_nothing(
    tmp_path: Path, make_sim: SimFactory, make_gateway: GatewayFactory, arguments: dict[str, Any]
) -> None:
    gw, _ = await _served(tmp_path, make_sim, make_gateway)
    answer = await _chat(gw, HELLO, session_id="tk-bad", chat_template_kwargs=arguments)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "chat_template_kwargs" and next(iter(arguments)) in error["message"]
    assert await gw.services.store.get_session("tk-bad") is None


async def test_the_config_refuses_an_argument_the_gateway_sets(tmp_path: Path) -> None:
    from pydantic import ValidationError

    from gateway.config import Settings

    with pytest.raises(ValidationError, match="add_generation_prompt cannot be a chat template argument"):
        Settings(model={"chat_template_kwargs": {"add_generation_prompt": False}})


async def _post(gw: RunningGateway, path: str, body: dict[str, Any], session: str) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as http:
        return await http.post(f"{gw.url}{path}", json=body, headers={"x-session-id": session})


async def test_the_responses_api_s_reasoning_effort_and_arguments_reach_the_template(
    tmp_path: Path, make_sim: SimFactory, make_gateway: GatewayFactory
) -> None:
    gw, tokenizer = await _served(tmp_path, make_sim, make_gateway)
    body = {"model": "tiny", "input": "hello", "max_output_tokens": 4, "reasoning": {"effort": "low"}}
    answer = await _post(gw, "/v1/responses", body, "tk-responses")
    assert answer.status_code == 200, answer.text
    text = await _prompt_text(gw, tokenizer, "tk-responses")
    assert "effort low" in text and "thinking off" not in text
    body = {"model": "tiny", "input": "hello", "max_output_tokens": 4, "chat_template_kwargs": {"tools": None}}
    refused = await _post(gw, "/v1/responses", body, "tk-responses-bad")
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "chat_template_kwargs"


async def test_anthropic_thinking_disabled_reaches_the_template_and_count_tokens_renders_the_same(
    tmp_path: Path, make_sim: SimFactory, make_gateway: GatewayFactory
) -> None:
    gw, tokenizer = await _served(tmp_path, make_sim, make_gateway)
    body = {"model": "tiny", "max_tokens": 4, "messages": HELLO, "thinking": {"type": "disabled"}}
    answer = await _post(gw, "/v1/messages", body, "tk-anthropic")
    assert answer.status_code == 200, answer.text
    text = await _prompt_text(gw, tokenizer, "tk-anthropic")
    assert text.startswith("<|im_start|>system\nthinking off<|im_end|>\n<|im_start|>system\neffort none")
    counted = await _post(gw, "/v1/messages/count_tokens", {k: v for k, v in body.items() if k != "max_tokens"}, "x")
    assert counted.status_code == 200, counted.text
    [sample] = await gw.services.store.load_samples("tk-anthropic")
    assert counted.json()["input_tokens"] == len(sample.prompt_ids)
