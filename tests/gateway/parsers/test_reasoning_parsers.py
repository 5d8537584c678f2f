"""The think-tag reasoning parsers (`qwen3`, `deepseek_r1`, `glm45`, `kimi_k2`): whole and streamed splits of each
family's markup, where the completion starts (the prompt's tail, rendered by a chat template in the family's format
that renders what the published one does), `auto` from those templates, and streaming that agrees with `parse` for
every chunking."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.parsers import (
    REASONING_PARSERS,
    ContentDelta,
    ReasoningDelta,
    ReasoningOutput,
    ReasoningStreamDelta,
    collect_reasoning,
    get_reasoning_parser,
    resolve_reasoning_parser,
)
from gateway.parsers.detect import detect_reasoning_format
from gateway.parsers.reasoning import (
    DeepSeekR1ReasoningParser,
    Glm45ReasoningParser,
    KimiK2ReasoningParser,
    Qwen3ReasoningParser,
)
from gateway.tokenization import ChatTokenizer
from gateway.turns.runner import PROMPT_TAIL_TOKENS
from tests.gateway.parsers.family_tokenizers import template_text
from tests.gateway.parsers.reasoning_families import FAMILIES, Family

TOOL_SECTION = "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}"


def test_the_registry_names_each_family_by_vllms_name() -> None:
    expected = {
        "qwen3": Qwen3ReasoningParser,
        "deepseek_r1": DeepSeekR1ReasoningParser,
        "glm45": Glm45ReasoningParser,
        "kimi_k2": KimiK2ReasoningParser,
        "kimi": KimiK2ReasoningParser,
    }
    assert set(expected) <= set(REASONING_PARSERS.names)
    for name, kind in expected.items():
        parser = get_reasoning_parser(name)
        assert type(parser) is kind
        # The families' think tags are added tokens that are not special: they are in the text an OpenAI client sees.
        assert parser.reads_special_tokens is False


CASES: list[tuple[str, str, str, str | None, str]] = [
    # (parser, prompt tail, completion, reasoning, content)
    ("qwen3", "", "<think>\nLet me see.\n</think>\n\nIt is 4.", "\nLet me see.\n", "\n\nIt is 4."),
    ("qwen3", "", "It is 4.", None, "It is 4."),
    ("qwen3", "", "\n\nIt is 4.", None, "\n\nIt is 4."),
    ("qwen3", "", "<think>\nstill thinking", "\nstill thinking", ""),  # cut by max_tokens
    ("qwen3", "", "<think>\nstill thinking</thi", "\nstill thinking</thi", ""),
    ("qwen3", "", "<think></think>\n\nHi", None, "\n\nHi"),  # empty reasoning is none
    ("qwen3", "", " \n<think>a</think>b", "a", "b"),  # whitespace before the start tag goes with it
    ("qwen3", "", "a</think>b", None, "a</think>b"),  # the start tag is not optional
    ("qwen3", "", "Hi <think>a</think>", None, "Hi <think>a</think>"),  # only at the start
    ("qwen3", "", "<think>a</think>b</think>c", "a", "b</think>c"),
    ("qwen3", "", "<thinking>", None, "<thinking>"),
    ("qwen3", "", "<thi", None, "<thi"),
    ("qwen3", "", "", None, ""),
    ("qwen3", "assistant\n<think>\n", "a</think>\n\nb", "a", "\n\nb"),  # the template opened it
    ("qwen3", "assistant\n<think>\n", "<think>a</think>b", "a", "b"),  # a second start tag is dropped
    ("qwen3", "assistant\n<think>\n", "cut short", "cut short", ""),
    ("qwen3", "<think>\n\n</think>\n\n", "Hi", None, "Hi"),  # enable_thinking=False
    ("deepseek_r1", "<｜Assistant｜><think>\n", "Hmm.\n</think>\n\nYes.", "Hmm.\n", "\n\nYes."),
    ("deepseek_r1", "", "Hmm.</think>Yes.", "Hmm.", "Yes."),  # the start tag is optional
    ("deepseek_r1", "", "no tags at all", "no tags at all", ""),
    ("deepseek_r1", "", "<think>a</think>b", "a", "b"),
    ("deepseek_r1", "<｜Assistant｜></think>", "Yes.", None, "Yes."),  # the prompt closed it
    ("glm45", "", "\n<think>abc</think>\nAnswer", "abc", "\nAnswer"),
    ("glm45", "", "Answer", None, "Answer"),
    ("glm45", "<|assistant|>\n<think></think>", "Answer", None, "Answer"),
    ("glm45", "", "<think>cut", "cut", ""),
    ("kimi_k2", "", "<think>plan</think>Done.", "plan", "Done."),
    ("kimi_k2", "", "plan</think>Done.", "plan", "Done."),
    ("kimi_k2", "", f"<think>plan{TOOL_SECTION}", "plan", TOOL_SECTION),  # a tool-call section ends it
    ("kimi_k2", "", f"<think>plan</think>{TOOL_SECTION}", "plan", TOOL_SECTION),
    ("kimi_k2", "", "<think>plan", "plan", ""),
]


@pytest.mark.parametrize(("name", "tail", "text", "reasoning", "content"), CASES)
def test_parse(name: str, tail: str, text: str, reasoning: str | None, content: str) -> None:
    assert get_reasoning_parser(name).parse(text, tail) == ReasoningOutput(reasoning, content)


def test_streaming_emits_as_the_text_arrives_holding_back_only_a_possible_tag() -> None:
    stream = get_reasoning_parser("qwen3").streaming()
    assert stream.feed("\n") == []  # whitespace at the start: a start tag may follow
    assert stream.feed("<thi") == []
    assert stream.feed("nk>\nabc") == [ReasoningDelta("\nabc")]
    assert stream.feed("de</th") == [ReasoningDelta("de")]
    assert stream.feed("ink>\n\nHel") == [ContentDelta("\n\nHel")]
    assert stream.feed("lo <think>") == [ContentDelta("lo <think>")]
    assert stream.finish() == []


def test_streaming_a_reply_without_reasoning_is_content_at_once() -> None:
    stream = get_reasoning_parser("glm45").streaming()
    assert stream.feed("Hi") == [ContentDelta("Hi")]
    assert stream.feed(" there") == [ContentDelta(" there")]
    assert stream.finish() == []


def test_streaming_a_cut_reasoning_flushes_the_held_tag_prefix_as_reasoning() -> None:
    stream = get_reasoning_parser("deepseek_r1").streaming("<｜Assistant｜><think>\n")
    assert stream.feed("thinking </") == [ReasoningDelta("thinking ")]
    assert stream.finish() == [ReasoningDelta("</")]


def chunkings(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts})
    return [text[a:b] for a, b in itertools.pairwise([0, *points, len(text)])]


PARTS = st.one_of(
    st.text(max_size=6),
    st.sampled_from(["<think>", "</think>", "<thi", "</th", "\n", "  ", "<", TOOL_SECTION, "<|tool_calls"]),
)
TAILS = ["", "assistant\n<think>\n", "<think>\n\n</think>\n\n", "<think>", "</think>"]


@settings(max_examples=300, deadline=None)
@given(
    name=st.sampled_from(["qwen3", "deepseek_r1", "glm45", "kimi_k2"]),
    tail=st.sampled_from(TAILS),
    parts=st.lists(PARTS, max_size=8),
    cuts=st.lists(st.integers(0, 200), max_size=12),
)
def test_streaming_agrees_with_parse_for_every_chunking(
    name: str, tail: str, parts: list[str], cuts: list[int]
) -> None:
    text = "".join(parts)
    parser = get_reasoning_parser(name)
    stream = parser.streaming(tail)
    deltas: list[ReasoningStreamDelta] = []
    for piece in chunkings(text, cuts):
        deltas += stream.feed(piece)
    deltas += stream.finish()
    assert all(d.text for d in deltas)  # no empty deltas
    parsed = parser.parse(text, tail)
    assert collect_reasoning(deltas) == parsed
    # Nothing is lost but markup: the content is a suffix of the text, the reasoning a piece of it.
    assert text.endswith(parsed.content)
    assert parsed.reasoning is None or parsed.reasoning in text


def prompt_tail(tokenizer: ChatTokenizer, **template_kwargs: object) -> str:
    """The prompt's tail as the turn runner shows it to the parser: its last tokens, special tokens kept."""
    ids = tokenizer.render([{"role": "user", "content": "Hi"}], chat_template_kwargs=template_kwargs or None)
    return tokenizer.decode(ids[-PROMPT_TAIL_TOKENS:])


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ChatTokenizer]:
    folder: Path = tmp_path_factory.mktemp("families")
    return {f.parser: ChatTokenizer.load(f.tokenizer_dir(folder)) for f in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.parser)
def test_where_the_completion_starts_follows_the_templates_generation_prompt(
    family: Family, tokenizers: dict[str, ChatTokenizer]
) -> None:
    parser = get_reasoning_parser(family.parser)
    tail = prompt_tail(tokenizers[family.parser])
    if family.opens_reasoning:  # DeepSeek-R1's prompt ends in `<think>\n`: the model writes only the end tag
        assert tail.endswith("<think>\n")
        assert parser.parse("why</think>because", tail) == ReasoningOutput("why", "because")
    else:  # the model opens the reasoning itself
        assert "<think>" not in tail
        assert parser.parse("<think>why</think>because", tail) == ReasoningOutput("why", "because")


@pytest.mark.parametrize("name", ["qwen3", "glm45"])
def test_thinking_switched_off_in_the_template_makes_the_reply_content(
    name: str, tokenizers: dict[str, ChatTokenizer]
) -> None:
    tail = prompt_tail(tokenizers[name], enable_thinking=False)
    assert tail.endswith(("</think>\n\n", "<think></think>"))
    assert get_reasoning_parser(name).parse("Hi </think> there", tail) == ReasoningOutput(None, "Hi </think> there")


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.parser)
def test_auto_picks_the_parser_from_the_familys_template(family: Family) -> None:
    template = template_text(family.template)
    assert detect_reasoning_format(template) == family.parser
    assert type(resolve_reasoning_parser("auto", template)) is type(get_reasoning_parser(family.parser))


def test_auto_picks_none_for_a_template_without_reasoning(tokenizers: dict[str, ChatTokenizer]) -> None:
    from gateway.assets import TINY_TOKENIZER_DIR

    assert resolve_reasoning_parser("auto", (TINY_TOKENIZER_DIR / "chat_template.jinja").read_text()) is None


TOOL_TURN = {
    "role": "assistant",
    "content": "",
    "reasoning_content": "R-tool",
    "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}],
}


@pytest.mark.parametrize(
    ("name", "rendered"),
    [
        # Qwen3, GLM-4.5: reasoning of assistant turns after the last user message only.
        ("qwen3", {"R-early": False, "R-last": True, "R-tool": True}),
        ("glm45", {"R-early": False, "R-last": True, "R-tool": True}),
        # DeepSeek-R1: never (and it cuts whatever precedes `</think>` out of the content).
        ("deepseek_r1", {"R-early": False, "R-last": False}),
        # Kimi K2 Thinking: of turns after the last assistant turn without tool calls only, so not even the last
        # answer's once it is in the history.
        ("kimi_k2", {"R-early": False, "R-last": False, "R-tool": True}),
    ],
)
def test_which_earlier_reasoning_each_template_renders(
    name: str, rendered: dict[str, bool], tokenizers: dict[str, ChatTokenizer]
) -> None:
    """Templates that drop earlier turns' reasoning are not prefix-stable: the next turn's prompt does not extend
    the ids sampled before (the reasoning among them)."""
    early = [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1", "reasoning_content": "R-early"}]
    last = [{"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A2", "reasoning_content": "R-last"}]
    tool = [{"role": "user", "content": "Q2"}, TOOL_TURN, {"role": "tool", "tool_call_id": "call_1", "content": "ok"}]
    tokenizer = tokenizers[name]
    text = tokenizer.render_text(early + last, add_generation_prompt=False)
    if "R-tool" in rendered:
        text += tokenizer.render_text(early + tool)
    assert {marker: marker in text for marker in rendered} == rendered
