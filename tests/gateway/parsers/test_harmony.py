"""gpt-oss's harmony format: the `gpt_oss` reasoning parser and the `openai` tool parser (openai-harmony underneath).

Replies come from a chat template in gpt-oss's format (templates/gpt_oss.jinja, rendering what gpt-oss's published
template renders) on the tiny tokenizer dressed with gpt-oss's special tokens, or are the markup gpt-oss writes,
encoded by that tokenizer; they go through the parsers whole and streamed id by id (as
the turn pipeline feeds them), and end to end through a gateway over scripted simulator replicas.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.sim.engine import EngineSettings
from backends.sim.model import ModelShape
from gateway.errors import ConfigError
from gateway.parsers import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    ContentDelta,
    ParsedOutput,
    ReasoningOutput,
    ToolCall,
    collect_deltas,
    collect_reasoning,
    resolve_reasoning_parser,
    resolve_tool_parser,
)
from gateway.parsers.harmony import VOCAB_ENV, VOCAB_FILE, Body, End, HarmonyReader, Header, Text, harmony_encoding
from gateway.parsers.reasoning.gpt_oss import GptOssReasoningParser
from gateway.parsers.tool_calls.openai import OpenAIToolParser
from gateway.tokenization import ChatTokenizer, IncrementalDetokenizer
from tests.conftest import GatewayFactory, SimFactory
from tests.gateway.parsers.family_tokenizers import family_tokenizer_dir, template_text

HARMONY_TOKENS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"The {name.removeprefix('get_')} in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "A city."}}},
        },
    }
    for name in ("get_weather", "get_time")
]
USER = [{"role": "user", "content": "Weather and time in Paris?"}]
ANALYSIS = "<|channel|>analysis<|message|>The user wants the weather. Use the tool.<|end|>"
# gpt-oss's own form of a call: the recipient after the channel, the JSON constraint, `<|call|>`.
CALL = (
    '<|start|>assistant<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{{"city":"Paris"}}<|call|>'
)


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("gpt_oss")
    return family_tokenizer_dir(folder, template_text("gpt_oss"), special=HARMONY_TOKENS, eos="<|return|>")


@pytest.fixture(scope="module")
def tokenizer(gpt_oss_dir: Path) -> ChatTokenizer:
    return ChatTokenizer.load(gpt_oss_dir)


def counter_ids() -> Callable[[], str]:
    """Tool-call ids that are the same in every run (`parse` and a streamed pass can then be compared)."""
    numbers = itertools.count()
    return lambda: f"call_{next(numbers)}"


def template_reply(tokenizer: ChatTokenizer, assistant: dict[str, Any]) -> list[int]:
    """The ids the chat template writes for `assistant` after the user's turn: the reply the model was taught."""
    prompt = tokenizer.render(USER, TOOLS)
    full = tokenizer.render([*USER, assistant], TOOLS, add_generation_prompt=False)
    assert full[: len(prompt)] == prompt and tokenizer.decode(prompt).endswith("<|start|>assistant")
    return full[len(prompt) :]


def pipeline(tokenizer: ChatTokenizer, ids: list[int], *, cut: bool, streamed: bool) -> tuple[str | None, ParsedOutput]:
    """What the turn pipeline makes of a reply: ids decoded with the special tokens kept (the end-of-turn one
    silent), reasoning split off, the rest parsed for tool calls; whole, or streamed one id at a time."""
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=False, silent_ids=tokenizer.stop_token_ids)
    reasoning_parser = GptOssReasoningParser()
    tool_parser = OpenAIToolParser(id_factory=counter_ids())
    if not streamed:
        split = reasoning_parser.parse(detokenizer.feed(ids) + detokenizer.flush())
        return split.reasoning, tool_parser.parse(split.content, cut=cut)
    reasoning_stream, tool_stream = reasoning_parser.streaming(), tool_parser.streaming()
    reasoned, tool_deltas = [], []
    for text in [*(detokenizer.feed([i]) for i in ids), detokenizer.flush()]:
        reasoned += reasoning_stream.feed(text)
    reasoned += reasoning_stream.finish()
    split = collect_reasoning(reasoned)
    for delta in reasoned:  # the content deltas, in order, as the tool parser receives them
        if isinstance(delta, ContentDelta):
            tool_deltas += tool_stream.feed(delta.text)
    tool_deltas += tool_stream.finish(cut=cut)
    return split.reasoning, collect_deltas(tool_deltas, unfinished=tool_stream.unfinished)


def assert_pipeline(
    tokenizer: ChatTokenizer, ids: list[int], reasoning: str | None, expected: ParsedOutput, *, cut: bool = False
) -> None:
    for streamed in (False, True):
        assert pipeline(tokenizer, ids, cut=cut, streamed=streamed) == (reasoning, expected), streamed


# -- the parsers on the template's replies and gpt-oss's markup -----------------------------------------------------


def test_analysis_then_final(tokenizer: ChatTokenizer) -> None:
    ids = template_reply(tokenizer, {"role": "assistant", "thinking": "Easy: sunny.", "content": "Sunny, 21 °C."})
    assert tokenizer.decode(ids).endswith("<|channel|>final<|message|>Sunny, 21 °C.<|return|>")
    assert_pipeline(tokenizer, ids, "Easy: sunny.", ParsedOutput("Sunny, 21 °C."))


def test_analysis_then_a_tool_call(tokenizer: ChatTokenizer) -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    ids = template_reply(tokenizer, {"role": "assistant", "thinking": "Use the tool.", "tool_calls": [call]})
    # The template's form: the recipient before the channel.
    assert "<|start|>assistant to=functions.get_weather<|channel|>commentary json" in tokenizer.decode(ids)
    expected = ParsedOutput(None, [ToolCall("call_0", "get_weather", '{"city": "Paris"}')])
    assert_pipeline(tokenizer, ids, "Use the tool.", expected)
    # gpt-oss's own form.
    ids = tokenizer.encode(ANALYSIS + CALL.format(name="get_weather"))
    expected = ParsedOutput(None, [ToolCall("call_0", "get_weather", '{"city":"Paris"}')])
    assert_pipeline(tokenizer, ids, "The user wants the weather. Use the tool.", expected)


def test_two_tool_calls_with_reasoning_between(tokenizer: ChatTokenizer) -> None:
    more = "<|start|>assistant<|channel|>analysis<|message|>And the time.<|end|>"
    ids = tokenizer.encode(ANALYSIS + CALL.format(name="get_weather") + more + CALL.format(name="get_time"))
    calls = [ToolCall(f"call_{i}", name, '{"city":"Paris"}') for i, name in enumerate(("get_weather", "get_time"))]
    assert_pipeline(
        tokenizer, ids, "The user wants the weather. Use the tool.\nAnd the time.", ParsedOutput(None, calls)
    )


def test_a_reply_cut_in_its_analysis(tokenizer: ChatTokenizer) -> None:
    ids = tokenizer.encode(ANALYSIS)[:9]  # `<|channel|>analysis<|message|>` and a few words
    reasoning = tokenizer.decode(ids).split("<|message|>")[1]
    assert reasoning and "<|end|>" not in reasoning
    assert_pipeline(tokenizer, ids, reasoning, ParsedOutput(""), cut=True)


def test_a_reply_cut_in_a_call_drops_the_call(tokenizer: ChatTokenizer) -> None:
    full = tokenizer.encode(ANALYSIS + CALL.format(name="get_weather"))
    ids = full[: len(full) - 4]  # inside the arguments
    assert_pipeline(tokenizer, ids, "The user wants the weather. Use the tool.", ParsedOutput("", [], True), cut=True)
    # Not cut (a stop id ended it): the call counts when its arguments are whole.
    whole = tokenizer.encode(ANALYSIS + CALL.format(name="get_weather").removesuffix("<|call|>"))
    expected = ParsedOutput(None, [ToolCall("call_0", "get_weather", '{"city":"Paris"}')], True)
    assert_pipeline(tokenizer, whole, "The user wants the weather. Use the tool.", expected)


def test_without_tools_a_call_stays_markup_in_the_content() -> None:
    """No tools in the request: no tool parser runs, and the content carries the call as harmony markup (as a
    hermes `<tool_call>` block stays in the text); an answer and a preamble are plain text."""
    split = GptOssReasoningParser().parse(ANALYSIS + CALL.format(name="get_weather"))
    assert split == ReasoningOutput(
        "The user wants the weather. Use the tool.",
        '<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{"city":"Paris"}'
        "<|call|>",
    )
    preamble = "<|channel|>commentary<|message|>Checking. <|end|><|start|>assistant<|channel|>final<|message|>Done."
    assert GptOssReasoningParser().parse(preamble) == ReasoningOutput(None, "Checking. Done.")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Just text, no markup.", ParsedOutput("Just text, no markup.")),
        # A header the library refuses is text, markup and all.
        ("<|start|>nobody<|message|>hi", ParsedOutput("<|start|>nobody<|message|>hi")),
        # A body that is not a JSON object: the call is content.
        (
            "<|start|>assistant<|channel|>commentary to=functions.f<|message|>[1]<|call|>",
            ParsedOutput("<|start|>assistant to=functions.f<|channel|>commentary<|message|>[1]<|call|>"),
        ),
        # A whole harmony completion (no reasoning parser): the analysis is dropped, the answer is content.
        (ANALYSIS + "<|start|>assistant<|channel|>final<|message|>Sunny.", ParsedOutput("Sunny.")),
    ],
)
def test_the_tool_parser_on_other_text(text: str, expected: ParsedOutput) -> None:
    assert OpenAIToolParser().parse(text) == expected


def test_the_reader_reports_messages_and_text() -> None:
    reader = HarmonyReader()
    events = reader.feed(" to=functions.f<|chan") + reader.feed("nel|>commentary json<|message|>{}<|call|>tail<|e")
    assert events + reader.finish() == [
        Header("commentary", "functions.f", "json"),
        Body("{}"),
        End("<|call|>"),
        Text("tail"),
        Text("<|e"),
    ]


# -- parse equals the streamed deltas, for every chunking ----------------------------------------------------------

PIECES = [
    "<|start|>assistant",
    "<|channel|>",
    "analysis",
    "final",
    "commentary",
    " to=functions.f",
    " to=functions.g ",
    "<|constrain|>json",
    "<|message|>",
    "<|end|>",
    "<|call|>",
    "<|return|>",
    '{"a": 1}',
    "[1]",
    "é😀 漢",
    "<|",
    "|>",
    "<|reserved_2",  # a prefix of a special token, then maybe not
    "<|nottag",
    "<",
    " ",
    "\n",
    "x",
]


def chunked(text: str, cuts: list[int]) -> Iterator[str]:
    edges = [0, *sorted({c % (len(text) + 1) for c in cuts}), len(text)]
    return (text[a:b] for a, b in itertools.pairwise(edges))


@settings(max_examples=300, deadline=None)
@given(
    pieces=st.lists(st.sampled_from(PIECES), max_size=24),
    prefix=st.sampled_from(["", "<|channel|>analysis<|message|>", "<|channel|>final<|message|>", " to=functions.h"]),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=12),
    cut=st.booleans(),
)
def test_parse_equals_the_streamed_deltas_for_every_chunking(
    pieces: list[str], prefix: str, cuts: list[int], cut: bool
) -> None:
    text = prefix + "".join(pieces)
    reasoning_stream = GptOssReasoningParser().streaming()
    reasoned = [d for chunk in chunked(text, cuts) for d in reasoning_stream.feed(chunk)] + reasoning_stream.finish()
    assert collect_reasoning(reasoned) == GptOssReasoningParser().parse(text)
    tool_stream = OpenAIToolParser(id_factory=counter_ids()).streaming()
    deltas = [d for chunk in chunked(text, cuts) for d in tool_stream.feed(chunk)] + tool_stream.finish(cut=cut)
    whole = OpenAIToolParser(id_factory=counter_ids()).parse(text, cut=cut)
    assert collect_deltas(deltas, unfinished=tool_stream.unfinished) == whole


# -- registry, auto, and the vocabulary ----------------------------------------------------------------------------


def test_registered_under_vllms_names_and_picked_by_auto() -> None:
    assert isinstance(REASONING_PARSERS.get("gpt_oss"), GptOssReasoningParser)
    assert isinstance(TOOL_PARSERS.get("openai"), OpenAIToolParser)
    template = template_text("gpt_oss")
    assert isinstance(resolve_reasoning_parser("auto", template), GptOssReasoningParser)
    assert isinstance(resolve_tool_parser("auto", template), OpenAIToolParser)
    assert GptOssReasoningParser.reads_special_tokens and OpenAIToolParser.reads_special_tokens


@pytest.fixture
def fresh_encoding() -> Iterator[None]:
    """The encoding loaded anew in the test (the process keeps one), and again by whoever needs it next."""
    harmony_encoding.cache_clear()
    yield
    harmony_encoding.cache_clear()


@pytest.mark.usefixtures("fresh_encoding")
def test_a_vocabulary_folder_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / VOCAB_FILE).write_text("not a vocabulary\n")
    monkeypatch.setenv(VOCAB_ENV, str(tmp_path))
    with pytest.raises(ConfigError, match=rf"harmony encoding .*set {VOCAB_ENV} to a folder holding {VOCAB_FILE}"):
        TOOL_PARSERS.get("openai")
    monkeypatch.delenv(VOCAB_ENV)
    # Unset, the packaged copy is used, and the environment is left as it was.
    assert harmony_encoding().encode("<|call|>", allowed_special="all") == [200012]
    assert VOCAB_ENV not in os.environ


# -- end to end: a gateway over a scripted simulator --------------------------------------------------------------


async def gpt_oss_gateway(
    make_sim: SimFactory, make_gateway: GatewayFactory, tokenizer: ChatTokenizer, folder: Path
) -> tuple[Any, Any]:
    shape = ModelShape(vocab_size=tokenizer.vocab_size, eos_token_id=tokenizer.eos_token_id)
    sim = await make_sim("vllm", engine=EngineSettings(shape=shape))
    model = {"tokenizer": str(folder), "reasoning_parser": "gpt_oss", "tool_parser": "openai"}
    return sim, await make_gateway([sim], model=model)


def script(sim: Any, tokenizer: ChatTokenizer, tools: list[dict[str, Any]] | None, reply: str) -> list[int]:
    """Make the simulator answer the user's turn with `reply`'s ids (then `<|return|>`, its EOS)."""
    ids = tokenizer.encode(reply)
    sim.engine.add_script(tokenizer.render(USER, tools)[-12:], ids)
    return ids


async def chat(api: openai.AsyncOpenAI, tools: list[dict[str, Any]] | None, stream: bool, **extra: Any) -> Any:
    kwargs: dict[str, Any] = {"model": "tiny", "messages": USER, "max_tokens": 200, "temperature": 0}
    if tools:
        kwargs["tools"] = tools
    return await api.chat.completions.create(stream=stream, **(kwargs | extra))


@pytest.mark.parametrize("stream", [False, True])
async def test_end_to_end_reasoning_and_content(
    stream: bool,
    make_sim: SimFactory,
    make_gateway: GatewayFactory,
    http: httpx.AsyncClient,
    tokenizer: ChatTokenizer,
    gpt_oss_dir: Path,
) -> None:
    sim, gw = await gpt_oss_gateway(make_sim, make_gateway, tokenizer, gpt_oss_dir)
    ids = script(sim, tokenizer, None, ANALYSIS + "<|start|>assistant<|channel|>final<|message|>Sunny, 21 °C.")
    api = openai.AsyncOpenAI(base_url=f"{gw.url}/sessions/gpt-{stream}/v1", api_key="k", max_retries=0)
    answer = await chat(api, None, stream)
    if stream:
        reasoning, content, finish = "", "", None
        async for chunk in answer:
            for choice in chunk.choices:
                reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
                content += choice.delta.content or ""
                finish = choice.finish_reason or finish
    else:
        message = answer.choices[0].message
        reasoning, content, finish = (
            message.model_extra["reasoning_content"],
            message.content,
            answer.choices[0].finish_reason,
        )
    assert (reasoning, content, finish) == ("The user wants the weather. Use the tool.", "Sunny, 21 °C.", "stop")
    # The trajectory keeps the exact ids: the scripted reply and the EOS.
    [sample] = await gw.services.store.load_samples(f"gpt-{stream}")
    assert sample.response_ids.tolist() == [*ids, tokenizer.eos_token_id]
    assert sample.prompt_ids.tolist() == tokenizer.render(USER)
    await api.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_end_to_end_tool_calls(
    stream: bool, make_sim: SimFactory, make_gateway: GatewayFactory, tokenizer: ChatTokenizer, gpt_oss_dir: Path
) -> None:
    sim, gw = await gpt_oss_gateway(make_sim, make_gateway, tokenizer, gpt_oss_dir)
    call = ANALYSIS + CALL.format(name="get_weather")
    ids = tokenizer.encode(call)
    script(sim, tokenizer, TOOLS, call + "<|start|>assistant<|channel|>final<|message|>what it would sample on")
    api = openai.AsyncOpenAI(base_url=f"{gw.url}/sessions/calls-{stream}/v1", api_key="k", max_retries=0)
    # `<|call|>` ends generation: the parsers name it a turn-ending token, so the gateway asks the engine to stop at
    # it (as vLLM does for gpt-oss) without the agent sending a stop id; the text ends inside the call, which counts
    # as its arguments are whole.
    answer = await chat(api, TOOLS, stream)
    if stream:
        reasoning, content, finish, calls = "", "", None, {}
        async for chunk in answer:
            for choice in chunk.choices:
                reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
                content += choice.delta.content or ""
                finish = choice.finish_reason or finish
                for delta in choice.delta.tool_calls or []:
                    call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                    call["name"] += delta.function.name or ""
                    call["arguments"] += delta.function.arguments or ""
        tool_calls = [calls[i] for i in sorted(calls)]
    else:
        message = answer.choices[0].message
        reasoning, content, finish = (
            message.model_extra["reasoning_content"],
            message.content,
            answer.choices[0].finish_reason,
        )
        tool_calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls or []]
    assert reasoning == "The user wants the weather. Use the tool."
    assert not content and finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in tool_calls] == [("get_weather", {"city": "Paris"})]
    [sample] = await gw.services.store.load_samples(f"calls-{stream}")
    assert sample.response_ids.tolist() == ids  # up to and with `<|call|>`, exactly
    await api.close()


async def test_end_to_end_a_reply_cut_in_a_call(
    make_sim: SimFactory, make_gateway: GatewayFactory, tokenizer: ChatTokenizer, gpt_oss_dir: Path
) -> None:
    sim, gw = await gpt_oss_gateway(make_sim, make_gateway, tokenizer, gpt_oss_dir)
    ids = script(sim, tokenizer, TOOLS, ANALYSIS + CALL.format(name="get_weather"))
    api = openai.AsyncOpenAI(base_url=f"{gw.url}/sessions/cut/v1", api_key="k", max_retries=0)
    answer = await chat(api, TOOLS, False, max_tokens=len(ids) - 3)  # `max_tokens` overrides chat()'s
    choice = answer.choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls and not choice.message.content
    assert choice.message.model_extra["reasoning_content"] == "The user wants the weather. Use the tool."
    [sample] = await gw.services.store.load_samples("cut")
    assert sample.response_ids.tolist() == ids[: len(ids) - 3]
    await api.close()
