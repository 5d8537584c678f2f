"""The tool-call parsers of the model families (`gateway.parsers.tool_calls`), whole and streamed, on the markup each
family writes (tests/gateway/parsers/tool_families.py): calls, content around them, malformed calls, cuts."""

from __future__ import annotations

import itertools
import json
import string
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.parsers import TOOL_PARSERS, ParsedOutput, ToolCallDelta, ToolStreamDelta, collect_deltas
from gateway.parsers.detect import detect_tool_format
from gateway.parsers.tool_calls.glm45 import Glm45ToolParser
from gateway.parsers.tool_calls.kimi_k2 import KimiK2ToolParser
from gateway.parsers.tool_calls.llama3_json import Llama3JsonToolParser
from gateway.parsers.tool_calls.mistral import MistralToolParser, new_mistral_call_id
from gateway.parsers.tool_calls.qwen3_coder import Qwen3CoderToolParser
from gateway.parsers.tool_calls.stream import OnePassToolParser, partial_marker_suffix
from tests.gateway.parsers.family_tokenizers import template_text
from tests.gateway.parsers.tool_families import ADD, FAMILIES, TOOLS, WEATHER, Family

NAMES = sorted(FAMILIES)


def counter_ids() -> Callable[[], str]:
    numbers = itertools.count()
    return lambda: f"call_{next(numbers)}"


def parser(name: str) -> OnePassToolParser:
    """The registered parser of `name`, with counted ids (`call_0`, ...) where the markup carries none."""
    made = TOOL_PARSERS.get(name)
    assert isinstance(made, OnePassToolParser)
    return type(made)(id_factory=counter_ids())  # type: ignore[call-arg]


def calls_of(parsed: ParsedOutput) -> list[tuple[str, dict[str, Any]]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


def streamed(name: str, pieces: list[str], *, cut: bool = False, tools: Any = TOOLS) -> ParsedOutput:
    stream = parser(name).streaming(tools=tools)
    deltas: list[ToolStreamDelta] = []
    for piece in pieces:
        deltas += stream.feed(piece)
    deltas += stream.finish(cut=cut)
    return collect_deltas(deltas, unfinished=stream.unfinished)


def both(name: str, text: str, *, cut: bool = False) -> ParsedOutput:
    """`parse(text)`, checked equal to the text streamed one character at a time."""
    whole = parser(name).parse(text, cut=cut, tools=TOOLS)
    assert streamed(name, list(text), cut=cut) == whole
    return whole


@pytest.fixture(params=NAMES)
def family(request: pytest.FixtureRequest) -> Family:
    return FAMILIES[request.param]


def test_every_format_is_registered_by_its_vllm_name() -> None:
    assert set(NAMES) | {"hermes"} <= set(TOOL_PARSERS.names)


def test_one_and_two_calls(family: Family) -> None:
    one = both(family.name, family.markup([ADD]))
    assert one.content is None and calls_of(one) == [ADD] and not one.unfinished
    two = both(family.name, family.markup([ADD, WEATHER]))
    assert two.content is None and calls_of(two) == [ADD, WEATHER]
    assert len({c.id for c in two.tool_calls}) == 2


def test_content_around_calls(family: Family) -> None:
    after = both(family.name, f"{family.markup([ADD])}\nDone.")
    assert calls_of(after) == [ADD] and after.content == "\nDone."
    if family.prose_first:
        before = both(family.name, f"Let me check 🙂\n{family.markup([ADD, WEATHER])}\n")
        assert before.content == "Let me check 🙂" and calls_of(before) == [ADD, WEATHER]


def test_text_without_calls_is_the_content_exactly(family: Family) -> None:
    for text in ["", "  ", "plain answer\n", "a < b [x] {y}", family.opener[:-1], f"x {family.opener[:-1]}"]:
        assert both(family.name, text) == ParsedOutput(text, [])


def test_malformed_calls_stay_content_verbatim(family: Family) -> None:
    for bad in family.malformed:
        assert both(family.name, bad) == ParsedOutput(bad, []), bad
        if family.prose_first:
            parsed = both(family.name, f"before {bad} after {family.markup([ADD])}")
            assert parsed.content == f"before {bad} after" and calls_of(parsed) == [ADD], bad
        else:  # a reply is its calls, then text: after a call, a bad one is the rest of the text
            parsed = both(family.name, f"{family.markup([ADD])}; {bad}")
            assert parsed.content == f"; {bad}" and calls_of(parsed) == [ADD], bad


def test_a_cut_reply_drops_the_call_it_ended_in(family: Family) -> None:
    """Cut by max_tokens inside a call (or the markup opening it): the partial markup is neither content nor a call,
    whole and streamed; the calls before it stand, and the reply is `unfinished` once its calls were opened."""
    first, second = family.markup([ADD]), family.markup([WEATHER])
    for size in range(1, len(second) - len(family.closer)):
        parsed = both(family.name, f"{first}\n{second[:size]}", cut=True)
        assert parsed.content is None and calls_of(parsed) == [ADD], second[:size]
        assert parsed.unfinished == (size >= len(family.opener)), second[:size]
    if family.closer and family.name != "mistral":  # a section cut after its last call: the calls stand, unfinished
        parsed = both(family.name, f"{first}\n{second[: -len(family.closer)]}", cut=True)
        assert parsed == ParsedOutput(None, parsed.tool_calls, unfinished=True)
        assert calls_of(parsed) == [ADD, WEATHER]


def test_a_cut_reply_keeps_the_prose_before_its_call(family: Family) -> None:
    markup = family.markup([WEATHER])
    parsed = both(family.name, "Checking." + markup[: len(markup) // 2], cut=True)
    expected = "Checking." if family.prose_first else "Checking." + markup[: len(markup) // 2]
    assert parsed == ParsedOutput(expected, [], unfinished=family.prose_first)


def test_an_unclosed_final_call_without_a_cut_counts_when_valid() -> None:
    """The completion ended (EOS) before the end marker: the call's body decides."""
    kimi = "<|tool_calls_section_begin|><|tool_call_begin|>functions.add:0<|tool_call_argument_begin|>{}"
    assert calls_of(both("kimi_k2", kimi)) == [("add", {})]
    qwen = "ok\n<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n</function>"
    assert both("qwen3_coder", qwen) == ParsedOutput("ok", both("qwen3_coder", qwen).tool_calls, unfinished=True)
    broken = "ok <tool_call>add\n<arg_key>a"
    assert both("glm45", broken) == ParsedOutput(broken, [], unfinished=True)


@pytest.mark.parametrize(
    ("name", "text", "plain", "typed"),
    [
        (
            "qwen3_coder",
            "<tool_call>\n<function=f>\n<parameter=n>\n7\n</parameter>\n<parameter=s>\n7\n</parameter>\n"
            "<parameter=x>\n1.5\n</parameter>\n<parameter=ok>\nTrue\n</parameter>\n"
            '<parameter=items>\n[1, "two"]\n</parameter>\n<parameter=text>\nline one\nline two\n</parameter>\n'
            "</function>\n</tool_call>",
            {"n": "7", "s": "7", "x": "1.5", "ok": "True", "items": '[1, "two"]', "text": "line one\nline two"},
            {"n": 7, "s": "7", "x": 1.5, "ok": True, "items": [1, "two"], "text": "line one\nline two"},
        ),
        (
            "glm45",
            "<tool_call>f\n<arg_key>n</arg_key>\n<arg_value>7</arg_value>\n<arg_key>s</arg_key>\n<arg_value>7</arg_value>"
            "\n<arg_key>x</arg_key>\n<arg_value>1.5</arg_value>\n<arg_key>ok</arg_key>\n<arg_value>true</arg_value>"
            '\n<arg_key>items</arg_key>\n<arg_value>[1, "two"]</arg_value>\n<arg_key>text</arg_key>\n'
            "<arg_value>line one\nline two</arg_value>\n</tool_call>",
            {"n": 7, "s": 7, "x": 1.5, "ok": True, "items": [1, "two"], "text": "line one\nline two"},
            {"n": 7, "s": "7", "x": 1.5, "ok": True, "items": [1, "two"], "text": "line one\nline two"},
        ),
    ],
)
def test_text_arguments_are_typed_by_the_tools_schema(
    name: str, text: str, plain: dict[str, Any], typed: dict[str, Any]
) -> None:
    properties = {
        "n": {"type": "integer"},
        "s": {"type": "string"},
        "x": {"type": "number"},
        "ok": {"type": "boolean"},
        "items": {"type": "array"},
        "text": {"type": ["string", "null"]},
    }
    tools = [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": properties}}}
    ]
    without = parser(name).parse(text)
    assert [json.loads(c.arguments) for c in without.tool_calls] == [plain]
    with_tools = parser(name).parse(text, tools=tools)
    assert [json.loads(c.arguments) for c in with_tools.tool_calls] == [typed]
    assert streamed(name, list(text), tools=tools) == with_tools


def test_kimi_ids_are_the_models_own() -> None:
    parsed = KimiK2ToolParser().parse(FAMILIES["kimi_k2"].markup([ADD, WEATHER]))
    assert [c.id for c in parsed.tool_calls] == ["functions.add:0", "functions.get_weather:1"]
    bare = "<|tool_calls_section_begin|><|tool_call_begin|>add:3<|tool_call_argument_begin|>{}<|tool_call_end|>"
    assert [(c.id, c.name) for c in KimiK2ToolParser().parse(bare).tool_calls] == [("add:3", "add")]


def test_mistral_ids_and_the_v11_form() -> None:
    parsed = MistralToolParser().parse(FAMILIES["mistral"].markup([ADD, WEATHER]))
    assert [c.id for c in parsed.tool_calls] == ["call00000", "call00001"]  # the model's, which its template writes
    v11 = '[TOOL_CALLS]add[ARGS]{"a": 2, "b": 3}[TOOL_CALLS]get_weather[CALL_ID]abc123XYZ[ARGS]{"city": "Zürich 🏔"}'
    parsed = MistralToolParser().parse(v11)
    assert parsed.content is None and calls_of(parsed) == [ADD, WEATHER]
    made = parsed.tool_calls[0].id
    assert len(made) == 9 and made.isalnum() and parsed.tool_calls[1].id == "abc123XYZ"
    assert all(len(i) == 9 and set(i) <= set(string.ascii_letters + string.digits) for i in {new_mistral_call_id()})
    assert streamed("mistral", list(v11)).tool_calls[1:] == parsed.tool_calls[1:]


def test_llama_takes_the_python_tag_and_both_argument_keys() -> None:
    text = '<|python_tag|>{"name": "add", "arguments": {"a": 2, "b": 3}};\n{"name": "now", "parameters": {}}'
    parsed = both("llama3_json", text)
    assert parsed.content is None and calls_of(parsed) == [ADD, ("now", {})]
    assert Llama3JsonToolParser().parse("Sure: " + FAMILIES["llama3_json"].markup([ADD])).tool_calls == []


def test_qwen3_coder_and_glm45_read_what_hermes_would_not() -> None:
    assert Qwen3CoderToolParser().parse('<tool_call>{"name": "add", "arguments": {}}</tool_call>').tool_calls == []
    pairs = "<arg_key>a</arg_key><arg_value>2</arg_value><arg_key>b</arg_key><arg_value>3</arg_value>"
    flat = f"<tool_call>add{pairs}</tool_call>"  # GLM-4.6's template: no newlines
    assert calls_of(Glm45ToolParser().parse(flat, tools=TOOLS)) == [ADD]


@pytest.mark.parametrize(
    ("name", "special"),
    [
        ("hermes", False),
        ("qwen3_coder", False),
        ("glm45", False),
        ("llama3_json", False),
        ("kimi_k2", True),
        ("deepseek_v3", True),
        ("mistral", True),
    ],
)
def test_which_parsers_read_special_tokens(name: str, special: bool) -> None:
    assert TOOL_PARSERS.get(name).reads_special_tokens is special


def test_auto_finds_each_format_in_its_familys_template(family: Family) -> None:
    assert detect_tool_format(template_text(family.name)) == family.name


def test_partial_marker_suffix() -> None:
    assert partial_marker_suffix("ab <tool", ("<tool_call>", "<x>")) == 5
    assert partial_marker_suffix("ab <", ("<tool_call>", "<x>")) == 1
    assert partial_marker_suffix("<tool_call>", ("<tool_call>",)) == 0


def chunkings(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts})
    return [text[a:b] for a, b in itertools.pairwise([0, *points, len(text)])]


def texts(family: Family) -> list[str]:
    one, two = family.markup([ADD]), family.markup([ADD, WEATHER])
    prose = "Sure — checking 🙂\n" if family.prose_first else ""
    return [
        one,
        f"{two}\n",
        f"{prose}{one}\n{family.markup([WEATHER])}",
        f"{prose}{family.malformed[0]} then {one}",
        f"  \n{one}\n  ",
        f"{one}{one[: len(one) // 2]}",
        f"no calls, just {family.opener[:3]} and {family.opener}",
        "   ",
    ]


@settings(max_examples=300, deadline=None)
@given(
    name=st.sampled_from(NAMES),
    index=st.integers(0, 7),
    cuts=st.lists(st.integers(0, 240), max_size=12),
    cut=st.booleans(),
)
def test_streaming_agrees_with_parse(name: str, index: int, cuts: list[int], cut: bool) -> None:
    text = texts(FAMILIES[name])[index]
    stream = parser(name).streaming(tools=TOOLS)
    deltas: list[ToolStreamDelta] = []
    for piece in chunkings(text, cuts):
        deltas += stream.feed(piece)
    deltas += stream.finish(cut=cut)
    assert collect_deltas(deltas, unfinished=stream.unfinished) == parser(name).parse(text, cut=cut, tools=TOOLS)
    for call_index in {d.index for d in deltas if isinstance(d, ToolCallDelta)}:
        first, *rest = [d for d in deltas if isinstance(d, ToolCallDelta) and d.index == call_index]
        assert first.id is not None and first.name is not None and first.arguments == ""  # id and name first
        assert [(d.id, d.name) for d in rest] == [(None, None)] and json.loads(rest[0].arguments) is not None


@st.composite
def marked_text(draw: st.DrawFn) -> tuple[str, str]:
    """A format and text made of its markup's pieces and other text, in any order."""
    name = draw(st.sampled_from(NAMES))
    family = FAMILIES[name]
    markup = family.markup([ADD])
    pieces = [markup, family.opener, markup[: len(markup) // 2], markup[len(markup) // 2 :], *family.malformed]
    parts = draw(st.lists(st.one_of(st.text(max_size=6), st.sampled_from(pieces)), max_size=6))
    return name, "".join(parts)


@settings(max_examples=300, deadline=None)
@given(marked=marked_text(), cuts=st.lists(st.integers(0, 400), max_size=10), cut=st.booleans())
def test_streaming_agrees_with_parse_on_random_text(marked: tuple[str, str], cuts: list[int], cut: bool) -> None:
    name, text = marked
    parsed = parser(name).parse(text, cut=cut, tools=TOOLS)
    assert streamed(name, chunkings(text, cuts), cut=cut) == parsed
    if not parsed.tool_calls and not cut:
        assert parsed.content == text
