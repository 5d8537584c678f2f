"""The teacher's checks of both tiers (issue 54 §3): a real engine scores a sequence (`backends.scoring`) as it
sampled it."""

from __future__ import annotations

import time

import httpx
import numpy as np

from backends.base import ReplicaSpec
from backends.factory import create_backend
from tests.engines.direct import greedy, prompt_of
from tests.engines.servers import EngineServer


async def scores_match_what_the_engine_sampled(http: httpx.AsyncClient, server: EngineServer) -> None:
    """The engine's own greedy tokens, scored by it as a teacher scores a sample (one prefill over prompt and
    answer): each token's logprob is the one it reported while decoding (another kernel, so within float32
    noise), and each is the best at its position."""
    prompt, n = prompt_of(24, seed=11), 16
    tokens, logprobs = await greedy(http, server, prompt, n)
    backend = create_backend(server.kind, ReplicaSpec(id="teacher", url=server.url, model="tiny"))
    try:
        scores = await backend.scorer.score(prompt + tokens, len(prompt), top_k=2)
        np.testing.assert_allclose(scores.logprobs, logprobs, atol=1e-3)
        assert scores.top_ids[:, 0].tolist() == tokens
        np.testing.assert_allclose(scores.top_logprobs[:, 0], scores.logprobs, atol=1e-5)
        long = prompt_of(2048, seed=12)  # what scoring a long sample costs (printed, not asserted)
        began = time.perf_counter()
        await backend.scorer.score(long, 1, top_k=4)
        per_1k = (time.perf_counter() - began) / 2047 * 1000
        print(f"\n{server.kind} teacher scoring: {per_1k:.3f} s per 1k tokens (2047 scored, top 4)")
    finally:
        await backend.aclose()
