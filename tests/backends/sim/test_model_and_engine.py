"""The simulator's deterministic model and engine semantics, without HTTP (cheap, so the edge cases live here)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from backends.sim.engine import EngineSettings, SamplingSpec, SimEngine, SimRequest, SimRequestError
from backends.sim.model import PREFIX_HASH_START, ModelShape, TokenModel, extend_prefix_hash, prefix_hashes, weights_key
from backends.sim.reference import reference_tokens
from common.hashing import string_key

SHAPE = ModelShape()
MODEL = TokenModel(SHAPE)
INIT = ("init", "default")
PROMPT = [5, 100, 200, 300, 400, 500, 600, 700]
WKEY = weights_key(*INIT)


def key(wkey: int = WKEY, seed: int = 0) -> int:
    return TokenModel.sample_key(wkey, seed)


def hashes(n: int, start: int = 0) -> list[int]:
    """Prefix hashes of n distinct one-token prompts (independent draws)."""
    return [extend_prefix_hash(PREFIX_HASH_START, t) for t in range(start, start + n)]


# -- hashing ----------------------------------------------------------------------------------------------------


def test_prefix_hashes_are_rolling() -> None:
    all_hashes = prefix_hashes(PROMPT)
    assert len(all_hashes) == len(PROMPT) and len(set(all_hashes)) == len(PROMPT)
    assert prefix_hashes(PROMPT[3:], all_hashes[2]) == all_hashes[3:]  # a prefix's hash continues the rolling state
    assert prefix_hashes([1, 2]) != prefix_hashes([2, 1])


def test_keys_are_stable_and_distinct() -> None:
    # Fixed values: Python's hash() is salted per process, these must not be (replicas must agree).
    assert string_key("init") == string_key("init") != string_key("init2")
    assert weights_key("init", "default") != weights_key("init", "v2") != weights_key("ckpt2", "default")
    assert weights_key("a", "b") != weights_key("b", "a")


# -- draw -------------------------------------------------------------------------------------------------------


def test_draw_is_deterministic() -> None:
    h = hashes(1)[0]
    assert MODEL.draw(h, key(), allow_eos=True, num_top=3) == MODEL.draw(h, key(), allow_eos=True, num_top=3)
    assert TokenModel(ModelShape()).draw(h, key(), allow_eos=True) == MODEL.draw(h, key(), allow_eos=True)


def test_draw_depends_on_weights_seed_and_prefix() -> None:
    # One draw may collide by chance (1 in ~2000); a run of 64 cannot.
    def tokens(wkey: int, seed: int, start: int = 0) -> list[int]:
        return [MODEL.draw(h, key(wkey, seed), allow_eos=False).token for h in hashes(64, start)]

    base = tokens(WKEY, 0)
    assert tokens(weights_key("init", "v2"), 0) != base
    assert tokens(weights_key("ckpt2", "default"), 0) != base
    assert tokens(WKEY, 1) != base
    assert tokens(WKEY, 0, start=1000) != base
    assert tokens(WKEY, 0) == base


def test_greedy_ignores_the_seed() -> None:
    assert SamplingSpec(max_tokens=1, temperature=0.0, seed=123).effective_seed == 0
    assert SamplingSpec(max_tokens=1, temperature=0.7, seed=123).effective_seed == 123
    assert SamplingSpec(max_tokens=1, temperature=0.7).effective_seed == 0  # absent seed: still deterministic
    greedy = [reference_tokens(SHAPE, PROMPT, INIT, 32, seed=s, temperature=0.0, ignore_eos=True) for s in (0, 1, 7)]
    assert greedy[0] == greedy[1] == greedy[2]
    sampled = [reference_tokens(SHAPE, PROMPT, INIT, 32, seed=s, temperature=1.0, ignore_eos=True) for s in (1, 7)]
    assert sampled[0] != sampled[1] and sampled[0] != greedy[0]


@pytest.mark.parametrize("allow_eos", [True, False])
def test_tokens_avoid_the_special_range_except_eos(allow_eos: bool) -> None:
    shape = ModelShape(eos_prob=0.2, num_special=7, eos_token_id=2)
    model = TokenModel(shape)
    seen_eos = False
    for h in hashes(3000):
        draw = model.draw(h, key(), allow_eos=allow_eos, num_top=4)
        if draw.token == shape.eos_token_id:
            seen_eos = True
        else:
            assert shape.num_special <= draw.token < shape.vocab_size
        assert draw.logprob < 0
        alts = [t for t, _ in draw.top]
        assert alts[0] == draw.token and len(set(alts)) == 4
        assert all(shape.num_special <= t < shape.vocab_size for t in alts[1:])
        logprobs = [lp for _, lp in draw.top]
        assert logprobs == sorted(logprobs, reverse=True)  # best first
    assert seen_eos is allow_eos


@pytest.mark.parametrize("eos_prob", [0.0, 0.01, 0.1, 0.5])
def test_eos_frequency_follows_eos_prob(eos_prob: float) -> None:
    model = TokenModel(ModelShape(eos_prob=eos_prob))
    n = 20_000
    eos = sum(model.draw(h, key(), allow_eos=True).token == 2 for h in hashes(n))
    # Binomial sd at p=0.5 is ~70 of 20k: a 5-sd band, loose enough to never flake on a fixed hash family.
    assert abs(eos / n - eos_prob) <= 5 * (eos_prob * (1 - eos_prob) / n) ** 0.5 + 1e-9


# -- reference --------------------------------------------------------------------------------------------------


def test_reference_single_pair_equals_per_token_list() -> None:
    shape = ModelShape(eos_prob=0.05)
    for n in (1, 10, 200):
        assert reference_tokens(shape, PROMPT, INIT, n) == reference_tokens(shape, PROMPT, [INIT] * n, n)
    # A per-token list shorter than max_tokens bounds the output.
    assert reference_tokens(SHAPE, PROMPT, [INIT] * 3, 10, ignore_eos=True) == reference_tokens(
        SHAPE, PROMPT, INIT, 3, ignore_eos=True
    )


def test_reference_switches_weights_per_token() -> None:
    mixed = reference_tokens(SHAPE, PROMPT, [INIT] * 5 + [("ckpt2", "v2")] * 5, 10, ignore_eos=True)
    assert mixed[:5] == reference_tokens(SHAPE, PROMPT, INIT, 5, ignore_eos=True)
    assert mixed[5:] == reference_tokens(SHAPE, PROMPT + mixed[:5], ("ckpt2", "v2"), 5, ignore_eos=True)
    assert mixed[5:] != reference_tokens(SHAPE, PROMPT, INIT, 10, ignore_eos=True)[5:]


def test_reference_stops() -> None:
    shape = ModelShape(eos_prob=0.3)
    free = reference_tokens(shape, PROMPT, INIT, 200, ignore_eos=True)
    assert 2 not in free and len(free) == 200
    stopped = reference_tokens(shape, PROMPT, INIT, 200)
    assert stopped[-1] == 2 and 2 not in stopped[:-1] and len(stopped) < 200
    late = reference_tokens(shape, PROMPT, INIT, 200, min_tokens=50)
    assert len(late) > 50 and 2 not in late[:50] and late[-1] == 2
    stop_at = free[10]
    by_stop = reference_tokens(shape, PROMPT, INIT, 200, ignore_eos=True, stop_token_ids=[stop_at])
    assert by_stop == free[: free.index(stop_at) + 1]


@settings(max_examples=150, deadline=None)
@given(
    prompt=st.lists(st.integers(0, SHAPE.vocab_size - 1), min_size=1, max_size=40),
    n=st.integers(0, 64),
    seed=st.integers(0, 2**64 - 1),
    temperature=st.sampled_from([0.0, 1.0]),
    eos_prob=st.sampled_from([0.0, 0.05, 0.3]),
    ignore_eos=st.booleans(),
    data=st.data(),
)
def test_continuation_equals_uninterrupted(
    prompt: list[int], n: int, seed: int, temperature: float, eos_prob: float, ignore_eos: bool, data: st.DataObject
) -> None:
    """Resubmitting prompt + the first k tokens for the remaining n - k reproduces the uninterrupted run."""
    shape = ModelShape(eos_prob=eos_prob)

    def ref(p: list[int], m: int) -> list[int]:
        return reference_tokens(shape, p, INIT, m, seed=seed, temperature=temperature, ignore_eos=ignore_eos)

    full = ref(prompt, n)
    k = data.draw(st.integers(0, len(full)), label="k")
    # A run that ended on EOS before n has nothing to continue from its end.
    assume(k < len(full) or len(full) == n)
    assert full[:k] + ref(prompt + full[:k], n - k) == full


# -- routed experts ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("experts", "dtype"), [(8, np.uint8), (256, np.uint8), (257, np.uint16), (300, np.uint16)])
def test_routed_experts_shape_and_dtype(experts: int, dtype: type[np.unsignedinteger]) -> None:
    shape = ModelShape(num_layers=3, top_k=4, num_experts=experts)
    model = TokenModel(shape)
    positions = prefix_hashes(PROMPT)
    routed = model.routed_experts(positions, [WKEY] * len(positions))
    assert routed.shape == (len(PROMPT), 3, 4) and routed.dtype == dtype and shape.expert_dtype == dtype
    assert int(routed.max()) < experts
    for row in routed.reshape(-1, 4).tolist():  # top-k experts of one (position, layer) are distinct
        assert len(set(row)) == 4
    empty = model.routed_experts([], [])
    assert empty.shape == (0, 3, 4) and empty.dtype == dtype


def test_expert_dtype_above_uint16() -> None:
    assert ModelShape(num_experts=65536, top_k=2).expert_dtype == np.uint16
    assert ModelShape(num_experts=65537, top_k=2).expert_dtype == np.uint32


def test_routed_experts_are_deterministic_per_prefix_and_weights() -> None:
    shape = ModelShape(num_layers=4, top_k=2, num_experts=64)
    positions = prefix_hashes(PROMPT + list(range(10, 40)))
    first = TokenModel(shape).routed_experts(positions, [WKEY] * len(positions))
    again = TokenModel(shape).routed_experts(positions, [WKEY] * len(positions))
    assert np.array_equal(first, again)
    # Position p depends on the prefix through p only: a longer sequence extends, it does not rewrite.
    short = TokenModel(shape).routed_experts(positions[:5], [WKEY] * 5)
    assert np.array_equal(short, first[:5])
    # Layers route differently (otherwise the layer axis would carry no information).
    assert not all(np.array_equal(first[:, 0], first[:, layer]) for layer in range(1, 4))
    other = weights_key("ckpt2", "v2")
    changed = TokenModel(shape).routed_experts(positions, [other] * len(positions))
    assert not np.array_equal(changed, first)
    # Weights are per position: a mixed list changes exactly the positions computed under other weights.
    mixed = TokenModel(shape).routed_experts(positions, [WKEY] * 10 + [other] * (len(positions) - 10))
    assert np.array_equal(mixed[:10], first[:10]) and np.array_equal(mixed[10:], changed[10:])
    with pytest.raises(ValueError):
        TokenModel(shape).routed_experts(positions, [WKEY])  # one weights key per position


# -- ModelShape -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"eos_token_id": -1}, "eos_token_id"),
        ({"eos_token_id": 2048}, "eos_token_id"),
        ({"vocab_size": 7, "num_special": 7, "eos_token_id": 2}, "num_special"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": 9, "num_experts": 8}, "top_k"),
        ({"eos_prob": 1.0}, "eos_prob"),
        ({"eos_prob": -0.1}, "eos_prob"),
    ],
)
def test_model_shape_validation(kwargs: dict[str, float], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        ModelShape(**kwargs)  # type: ignore[arg-type]


# -- engine (in this loop, no HTTP) -----------------------------------------------------------------------------

EngineFactory = Callable[..., SimEngine]


@pytest.fixture
async def make_engine() -> AsyncIterator[EngineFactory]:
    engines: list[SimEngine] = []

    def make(**kwargs: object) -> SimEngine:
        engine = SimEngine(EngineSettings(**kwargs))  # type: ignore[arg-type]
        engine.start()
        engines.append(engine)
        return engine

    try:
        yield make
    finally:
        for engine in engines:
            await engine.stop()


async def finished(request: SimRequest) -> SimRequest:
    while not request.finished:
        request.updated.clear()
        await request.updated.wait()
    return request


async def produced(request: SimRequest, n: int) -> None:
    while len(request.output_ids) < n and not request.finished:
        request.updated.clear()
        await request.updated.wait()


def greedy(max_tokens: int, **kwargs: object) -> SamplingSpec:
    return SamplingSpec(max_tokens=max_tokens, temperature=0.0, **kwargs)  # type: ignore[arg-type]


async def test_engine_matches_reference(make_engine: EngineFactory) -> None:
    engine = make_engine()
    request = await finished(await engine.submit("r1", PROMPT, greedy(40, ignore_eos=True)))
    assert request.finish_reason == "length" and request.stop_reason is None
    assert request.output_ids == reference_tokens(SHAPE, PROMPT, INIT, 40, ignore_eos=True)
    assert request.versions == ["default"] * 40
    assert request.weight_version_spans() == [{"version": "default", "start": 0, "end": 40}]
    assert engine.counters["generation_tokens"] == 40 and engine.counters["finished_length"] == 1
    assert not engine.requests and engine.num_running == 0
    sampled = await finished(await engine.submit("r2", PROMPT, SamplingSpec(max_tokens=40, seed=9, ignore_eos=True)))
    assert sampled.output_ids == reference_tokens(SHAPE, PROMPT, INIT, 40, seed=9, temperature=1.0, ignore_eos=True)


async def test_engine_batches_concurrent_requests(make_engine: EngineFactory) -> None:
    engine = make_engine()
    prompts = [[10 + i, 20 + i, 30 + i] for i in range(8)]
    requests = [await engine.submit(f"r{i}", p, greedy(25, ignore_eos=True)) for i, p in enumerate(prompts)]
    for request, prompt in zip(requests, prompts, strict=True):
        assert (await finished(request)).output_ids == reference_tokens(SHAPE, prompt, INIT, 25, ignore_eos=True)
    assert engine.counters["steps"] < 8 * 25  # one step decodes every running request


async def test_engine_stops_on_eos_min_tokens_and_stop_ids(make_engine: EngineFactory) -> None:
    shape = ModelShape(eos_prob=0.3)
    engine = make_engine(shape=shape)
    eos = await finished(await engine.submit("eos", PROMPT, greedy(200)))
    assert eos.finish_reason == "stop" and eos.stop_reason is None and eos.output_ids[-1] == 2
    assert eos.output_ids == reference_tokens(shape, PROMPT, INIT, 200)
    late = await finished(await engine.submit("late", PROMPT, greedy(200, min_tokens=40)))
    assert len(late.output_ids) > 40 and late.output_ids == reference_tokens(shape, PROMPT, INIT, 200, min_tokens=40)
    free = reference_tokens(shape, PROMPT, INIT, 50, ignore_eos=True)
    spec = greedy(50, ignore_eos=True, stop_token_ids=frozenset({free[7]}))
    stop = await finished(await engine.submit("stop", PROMPT, spec))
    assert stop.finish_reason == "stop" and stop.stop_reason == free[7]
    assert stop.output_ids == free[: free.index(free[7]) + 1]


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "needle"),
    [
        ([], 4, "at least one token"),
        ([1, 2048], 4, "out of vocabulary"),
        ([1, -1], 4, "out of vocabulary"),
        ([1, 2], 0, "max_tokens"),
        ([1] * 10, 4087, "maximum context length"),
    ],
)
async def test_engine_validation(make_engine: EngineFactory, prompt: list[int], max_tokens: int, needle: str) -> None:
    engine = make_engine()
    with pytest.raises(SimRequestError, match=needle):
        await engine.submit("bad", prompt, greedy(max_tokens))
    assert not engine.requests and engine.counters["prompt_tokens"] == 0


async def test_engine_duplicate_id_and_abort_keeps_partial_output(make_engine: EngineFactory) -> None:
    engine = make_engine(token_delay_s=0.001)
    request = await engine.submit("dup", PROMPT, greedy(4000, ignore_eos=True))
    with pytest.raises(SimRequestError, match="already in flight"):
        await engine.submit("dup", PROMPT, greedy(4))
    await produced(request, 10)
    assert engine.abort("dup", "test abort") and not engine.abort("dup")
    assert request.finish_reason == "abort" and request.abort_message == "test abort"
    partial = request.output_ids
    assert 10 <= len(partial) < 4000
    assert partial == reference_tokens(SHAPE, PROMPT, INIT, len(partial), ignore_eos=True)
    assert not engine.requests and engine.counters["finished_abort"] == 1
    assert not engine.abort("unknown")


async def test_engine_weight_update_while_frozen(make_engine: EngineFactory) -> None:
    engine = make_engine(token_delay_s=0.001)
    request = await engine.submit("w", PROMPT, greedy(60, ignore_eos=True))
    await produced(request, 5)
    await engine.pause("keep")
    k = len(request.output_ids)
    engine.load_weights("ckpt2")
    engine.set_version("v2")
    engine.resume()
    await finished(request)
    assert request.weight_version_spans() == [
        {"version": "default", "start": 0, "end": k},
        {"version": "v2", "start": k, "end": 60},
    ]
    per_token = [INIT] * k + [("ckpt2", "v2")] * (60 - k)
    assert request.output_ids == reference_tokens(SHAPE, PROMPT, per_token, 60, ignore_eos=True)


async def test_engine_prefix_cache_and_routed_experts(make_engine: EngineFactory) -> None:
    shape = ModelShape(num_layers=3, top_k=2, num_experts=16)
    engine = make_engine(shape=shape, block_size=4)
    prompt = list(range(10, 21))  # 11 tokens: two full 4-token blocks are reusable (the last token never is)
    first = await finished(await engine.submit("a", prompt, greedy(6, ignore_eos=True)))
    second = await finished(await engine.submit("b", prompt, greedy(6, ignore_eos=True)))
    assert first.cached_tokens == 0 and second.cached_tokens == 8
    assert second.output_ids == first.output_ids
    experts = engine.routed_experts(first)
    # Every token that went through the model: prompt + output, minus the last sampled token.
    assert experts.shape == (len(prompt) + 6 - 1, 3, 2) and experts.dtype == np.uint8
    positions = prefix_hashes(prompt + first.output_ids)[:-1]
    wkey = weights_key(*INIT)
    assert np.array_equal(experts, TokenModel(shape).routed_experts(positions, [wkey] * len(positions)))
    assert np.array_equal(engine.routed_experts(second), experts)  # a cache hit routes the same
    assert np.array_equal(engine.routed_experts(first, start=5), experts[5:])
