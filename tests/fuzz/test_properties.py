"""Property tests (hypothesis): the token/expert merge of the resume loop, the Redis codecs of trajectories, the
vocabulary check of token-id lists, the decoding of model-written JSON for answers and the prompt bound over
conversations with tools."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.base import ReplicaSpec, SamplingParams, VersionSpan, spans_to_versions
from backends.factory import create_backend
from gateway.api.json_answer import model_json
from gateway.assets import TINY_TOKENIZER_DIR
from gateway.errors import InvalidRequest
from gateway.generation import GenerationRequest, GenerationState
from gateway.generation.segment_run import SegmentRun, close_segment
from gateway.routing import Engine, Replica
from gateway.tokenization import ChatTokenizer
from gateway.tokenization.token_ids import first_outside
from gateway.trajectory import ENV_VERSION, Sample, SampleSegment, SessionMeta, TrajectoryFormatError
from gateway.turns.prompts import PromptEncoder, conversation_texts
from gateway.turns.request import Conversation
from gateway.weights import parse_version, version_label

LAYERS, TOP_K = 2, 3


def experts_of(position: int, segment: int) -> np.ndarray:
    """What segment `segment` reports as the experts of `position` (distinct per segment, to see who won)."""
    return np.full((LAYERS, TOP_K), (position * 7 + segment * 1000) % 65000, dtype=np.uint16)


@pytest.fixture(scope="module")
def replica() -> Replica:
    backend = create_backend("sim", ReplicaSpec(id="r0", url="http://127.0.0.1:9"), "vllm")
    return Engine(backend).targets[0]


@settings(max_examples=100, deadline=None)
@given(
    prompt_len=st.integers(1, 40),
    counts=st.lists(st.integers(0, 12), min_size=1, max_size=8),
    experts_start=st.integers(0, 39),
    policy=st.sampled_from(["splice", "replace"]),
)
def test_resume_merge_keeps_every_token_once_with_its_experts(
    replica: Replica, prompt_len: int, counts: list[int], experts_start: int, policy: str
) -> None:
    """Segments of any sizes (empty ones included, first or later) merge into one completion: the tokens are the
    concatenation, versions follow the segments, and with `splice` every position keeps the experts reported by
    the first segment that ran it (the continuation contributes only new positions)."""
    experts_start = min(experts_start, prompt_len - 1)
    request = GenerationRequest(
        "req", list(range(prompt_len)), SamplingParams(max_tokens=sum(counts) + 1), want_routed_experts=True
    )
    request = GenerationRequest(**{**_fields(request), "experts_start": experts_start if policy == "splice" else 0})
    state = GenerationState(request)
    owner: dict[int, int] = {}
    for segment, count in enumerate(counts):
        run = SegmentRun(replica, len(state.output_ids), dispatch_version=segment, salted=False)
        before = prompt_len + len(state.output_ids)
        first = run.start == 0
        start = (request.experts_start if first else before - 1) if policy == "splice" else 0
        end = before + count - 1
        if count:
            run.experts = np.stack([experts_of(p, segment) for p in range(start, end)]).reshape(-1, LAYERS, TOP_K)
            for p in range(start, end):
                owner.setdefault(p, segment) if policy == "splice" else owner.__setitem__(p, segment)
        state.output_ids += [segment] * count
        state.logprobs += [-1.0] * count
        close_segment(state, run, policy)  # type: ignore[arg-type]
    total = sum(counts)
    assert state.output_ids == [s for s, c in enumerate(counts) for _ in range(c)]
    assert state.versions == state.output_ids  # each token carries the version of its segment
    assert [(s.start, s.end) for s in state.segments] == [
        (sum(counts[:i]), sum(counts[: i + 1])) for i in range(len(counts))
    ]
    if total == 0:
        assert state.routed_experts is None
        return
    assert state.routed_experts_complete and state.routed_experts is not None
    first_position = request.experts_start if policy == "splice" else 0
    expected = [experts_of(p, owner[p]) for p in range(first_position, prompt_len + total - 1)]
    assert state.routed_experts.shape == (len(expected), LAYERS, TOP_K)
    assert np.array_equal(state.routed_experts, np.stack(expected).reshape(-1, LAYERS, TOP_K))


LABELS = st.sampled_from(["0", "1", "2", "default"])


@settings(max_examples=200, deadline=None)
@given(
    count=st.integers(0, 12),
    dispatch=st.integers(0, 3),
    label=st.none() | LABELS,
    spans=st.none() | st.lists(st.tuples(LABELS, st.integers(-2, 14), st.integers(-2, 14)), max_size=3),
)
def test_a_segments_versions_follow_its_engine_labels(
    replica: Replica, count: int, dispatch: int, label: str | None, spans: list[tuple[str, int, int]] | None
) -> None:
    """Every token of a segment gets the version its engine labelled it with: the spans', else the segment's label,
    else the version it was dispatched under, whatever the spans cover (the one-label shortcut included)."""
    state = GenerationState(GenerationRequest("req", [1], SamplingParams(max_tokens=count + 1)))
    run = SegmentRun(replica, 0, dispatch_version=dispatch, salted=False)
    run.weight_version = label
    run.spans = None if spans is None else [VersionSpan(v, start, end) for v, start, end in spans]
    state.output_ids += [7] * count
    state.logprobs += [-1.0] * count
    close_segment(state, run, "splice")
    labels = spans_to_versions(run.spans or (), count, label or version_label(dispatch))
    assert state.versions == [parse_version(each) for each in labels]


def test_a_segment_that_produced_nothing_parses_no_label(replica: Replica) -> None:
    """An engine label that is no gateway version labels nothing when the segment has no tokens: no error."""
    state = GenerationState(GenerationRequest("req", [1], SamplingParams(max_tokens=4)))
    run = SegmentRun(replica, 0, dispatch_version=1, salted=False)
    run.weight_version = "not-a-version"
    close_segment(state, run, "splice")
    assert state.versions == [] and [(s.start, s.end) for s in state.segments] == [(0, 0)]


def _fields(request: GenerationRequest) -> dict[str, Any]:
    return {name: getattr(request, name) for name in request.__dataclass_fields__}


# -- Redis codecs ------------------------------------------------------------------------------------------------

I32 = st.integers(-(2**31), 2**31 - 1)


@st.composite
def samples(draw: st.DrawFn) -> Sample:
    n = draw(st.integers(0, 40))
    mask = draw(st.lists(st.integers(0, 1), min_size=n, max_size=n))
    versions = [draw(st.integers(0, 2**31 - 1)) if m else ENV_VERSION for m in mask]
    logprobs = [draw(st.floats(-1e6, 0, width=32)) if m else 0.0 for m in mask]
    experts = None
    if draw(st.booleans()):
        rows = draw(st.integers(0, 50))
        top = draw(st.sampled_from([7, 255, 256, 65535, 65536, 2**32 - 1]))
        experts = np.asarray(
            draw(st.lists(st.integers(0, top), min_size=rows * LAYERS * TOP_K, max_size=rows * LAYERS * TOP_K)),
            dtype=np.uint64,
        ).reshape(rows, LAYERS, TOP_K)
    json_values = st.recursive(
        st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.text(max_size=8),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
        max_leaves=6,
    )
    return Sample(
        prompt_ids=np.asarray(draw(st.lists(I32, max_size=30)), np.int32),
        response_ids=np.asarray(draw(st.lists(I32, min_size=n, max_size=n)), np.int32),
        loss_mask=np.asarray(mask, np.uint8),
        logprobs=np.asarray(logprobs, np.float32),
        versions=np.asarray(versions, np.int32),
        routed_experts=experts,
        num_turns=draw(st.integers(0, 1000)),
        cancelled=draw(st.booleans()),
        conversation=draw(st.none() | st.lists(st.dictionaries(st.text(max_size=6), json_values, max_size=3))),
        tools=draw(st.none() | st.lists(st.dictionaries(st.text(max_size=6), json_values, max_size=3))),
        num_resumes=draw(st.integers(0, 1000)),
        segments=draw(st.lists(segments(), max_size=4)),
        rewritten_from=draw(st.none() | st.integers(0, 2**31 - 1)),
    )


def segments() -> st.SearchStrategy[SampleSegment]:
    replica = st.text(st.characters(blacklist_characters="\n", blacklist_categories=["Cs"]), max_size=12)
    position = st.integers(0, 2**31 - 1)
    sampling = st.none() | st.fixed_dictionaries(
        {
            "temperature": st.floats(0, 100),
            "seed": st.none() | st.integers(-(2**63), 2**63 - 1),
            "stop": st.lists(st.text(max_size=4), max_size=2),
        }
    )
    return st.builds(SampleSegment, position, position, replica, position, sampling)


def as_stored(fields: dict[str, Any]) -> dict[bytes, bytes]:
    """What HGETALL returns for these fields: every key and value as bytes."""
    return {k.encode(): v if isinstance(v, bytes) else str(v).encode() for k, v in fields.items()}


@settings(max_examples=100, deadline=None)
@given(samples())
def test_sample_round_trips_through_its_redis_hash(sample: Sample) -> None:
    back = Sample.from_redis(as_stored(sample.to_redis()))
    for name in ("prompt_ids", "response_ids", "loss_mask", "logprobs", "versions"):
        assert np.array_equal(getattr(back, name), getattr(sample, name)), name
    assert (back.num_turns, back.cancelled) == (sample.num_turns, sample.cancelled)
    assert (back.num_resumes, back.segments) == (sample.num_resumes, sample.segments)
    assert back.rewritten_from == sample.rewritten_from
    assert back.conversation == sample.conversation and back.tools == sample.tools
    assert (back.min_version, back.max_version) == (sample.min_version, sample.max_version)
    if sample.routed_experts is None:
        assert back.routed_experts is None
    else:
        assert back.routed_experts is not None and back.routed_experts.shape == sample.routed_experts.shape
        assert np.array_equal(back.routed_experts.astype(np.uint64), sample.routed_experts)
        assert back.routed_experts.dtype.itemsize <= sample.routed_experts.dtype.itemsize  # smallest dtype


FIELD_NAMES = ["prompt_ids", "response_ids", "loss_mask", "logprobs", "versions", "experts", "experts_dtype"]


@settings(max_examples=100, deadline=None)
@given(
    samples(),
    st.sampled_from(
        [*FIELD_NAMES, "experts_shape", "num_turns", "num_resumes", "segments", "segment_replicas", "segment_sampling"]
    ),
    st.binary(max_size=24),
)
def test_a_corrupt_sample_hash_decodes_or_says_so(sample: Sample, name: str, garbage: bytes) -> None:
    """Whatever one field holds, decoding gives a consistent sample or TrajectoryFormatError, nothing else."""
    stored = as_stored(sample.to_redis())
    stored[name.encode()] = garbage
    try:
        back = Sample.from_redis(stored)
    except TrajectoryFormatError:
        return
    assert len(back.response_ids) == len(back.loss_mask) == len(back.logprobs) == len(back.versions)


@settings(max_examples=100, deadline=None)
@given(
    # 64-bit integers: the API refuses wider ones (400) before anything is stored.
    st.dictionaries(
        st.text(max_size=8), st.integers(-(2**63), 2**63 - 1) | st.text(max_size=8) | st.none(), max_size=4
    ),
    st.none() | st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from(["active", "finished", "abandoned"]),
    st.floats(0, 2e9),
    st.none() | st.text(min_size=1, max_size=12),
    st.none() | st.lists(st.floats(allow_nan=False, allow_infinity=False), min_size=1, max_size=4),
)
def test_session_meta_round_trips(
    metadata: dict[str, Any],
    reward: float | None,
    status: str,
    created: float,
    replica: str | None,
    rewards: list[float] | None,
) -> None:
    meta = SessionMeta("s", status, metadata, reward, 3, created, created, None, replica)  # type: ignore[arg-type]
    meta.rewards = rewards
    back = SessionMeta.from_redis("s", as_stored(meta.to_redis()))
    assert back == meta
    assert orjson.loads(orjson.dumps(back.metadata)) == metadata


VOCAB = 2048


@settings(max_examples=300, deadline=None)
@given(
    inside=st.lists(st.integers(0, VOCAB - 1), max_size=700),
    outside=st.lists(
        st.tuples(st.integers(0, 700), st.one_of(st.integers(max_value=-1), st.integers(min_value=VOCAB))),
        max_size=3,
    ),
)
def test_the_first_id_outside_the_vocabulary_is_found_at_any_length(
    inside: list[int], outside: list[tuple[int, int]]
) -> None:
    # Lists short and long (the long ones are checked in an int64 buffer), ids just outside either bound, and ids
    # beyond 64 bits, which the buffer cannot hold.
    ids = list(inside)
    for position, token in outside:
        ids.insert(min(position, len(ids)), token)
    expected = next((i for i, token in enumerate(ids) if not 0 <= token < VOCAB), None)
    assert first_outside(ids, VOCAB) == expected


@pytest.mark.parametrize("length", [1, 255, 256, 5000])
@pytest.mark.parametrize("bad", [-1, VOCAB, 2**63, -(2**70)])
def test_one_id_outside_among_many_is_found(length: int, bad: int) -> None:
    ids = [i % VOCAB for i in range(length)]
    assert first_outside(ids, VOCAB) is None
    for position in sorted({0, length // 2, length - 1}):
        assert first_outside([*ids[:position], bad, *ids[position + 1 :]], VOCAB) == position


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=2**64 - 2, max_value=2**64)
    | st.integers(min_value=10**40)
    | st.integers(max_value=-(2**63) - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(JSON_VALUES)
def test_model_json_answers_what_the_model_wrote(value: Any) -> None:
    """JSON a model wrote (a tool call's arguments), decoded for an answer and encoded by orjson, reads back as the
    same value, integers of any size included (they were a 500 on `/v1/messages`)."""
    written = json.dumps(value, ensure_ascii=False)
    assert json.loads(orjson.dumps(model_json(written))) == value


# Texts of few characters a token ("----") and of many ("中", "\\"), JSON's own characters and a control token's text.
PROMPT_TEXTS = st.lists(
    st.sampled_from([*'ab -_{}":,\n\t.é中\\', "word ", "----", "    ", "<|im_end|>"]), max_size=120
).map("".join)
NAMES = st.from_regex(r"[a-z]{1,8}", fullmatch=True)
SCHEMA_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**6), 10**6) | PROMPT_TEXTS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(PROMPT_TEXTS, inner, max_size=4),
    max_leaves=12,
)
TOOLS = st.builds(
    lambda name, description, properties: {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties},
        },
    },
    NAMES,
    PROMPT_TEXTS,
    st.dictionaries(PROMPT_TEXTS, SCHEMA_VALUES, max_size=4),
)
CALLS = st.builds(
    lambda name, arguments: {"id": "c1", "type": "function", "function": {"name": name, "arguments": arguments}},
    NAMES,
    PROMPT_TEXTS | st.dictionaries(PROMPT_TEXTS, SCHEMA_VALUES, max_size=3),
)
PARTS = st.lists(st.builds(lambda text: {"type": "text", "text": text}, PROMPT_TEXTS), min_size=1, max_size=3)
MESSAGES = st.one_of(
    st.builds(lambda content: {"role": "user", "content": content}, PROMPT_TEXTS | PARTS),
    st.builds(
        lambda content, calls: {"role": "assistant", "content": content} | ({"tool_calls": calls} if calls else {}),
        PROMPT_TEXTS,
        st.lists(CALLS, max_size=2),
    ),
    st.builds(lambda content: {"role": "tool", "tool_call_id": "c1", "content": content}, PROMPT_TEXTS),
)


@pytest.fixture(scope="module")
def tiny() -> ChatTokenizer:
    return ChatTokenizer.load(TINY_TOKENIZER_DIR)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(MESSAGES, min_size=1, max_size=5),
    st.lists(TOOLS, max_size=4),
    st.sampled_from([32, 48, 100]),
)
def test_the_prompt_bound_refuses_no_conversation_that_fits(
    tiny: ChatTokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]], context: int
) -> None:
    """The bound over a conversation's texts (tools, schemas, calls' arguments, contents) refuses only what the chat
    template renders to more tokens than the context: a lower bound, by length or counted in chunks."""
    conversation = Conversation([*messages, {"role": "user", "content": "x"}], tools or None)
    try:
        asyncio.run(PromptEncoder(tiny, context, lambda: 0).check_fits(conversation_texts(conversation)))
    except InvalidRequest as refused:
        rendered = len(tiny.render(conversation.messages, conversation.tools))
        assert rendered > context, refused.message
