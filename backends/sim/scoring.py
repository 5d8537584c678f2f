"""The simulator's prompt scoring (`backends.scoring` is the client): every prompt token's logprob given those before
it, under the engine's weights and the request's adapter, as `TokenModel.score` gives it; vLLM's `prompt_logprobs`
and SGLang's prefill-only `/generate` (`max_new_tokens: 0`) answer from it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from backends.sim.engine import SimEngine
from backends.sim.model import Draw

__all__ = ["prompt_scores", "sglang_input_logprobs", "vllm_prompt_logprobs"]


def prompt_scores(engine: SimEngine, prompt: Sequence[int], adapter_key: int, top_k: int) -> list[Draw]:
    """Entry i - 1 scores `prompt[i]` (i ≥ 1) given `prompt[:i]`, with the `top_k` best there."""
    return engine.model.score_sequence(prompt, engine.model.sample_key(engine.wkey ^ adapter_key, 0), 1, top_k)


def vllm_prompt_logprobs(
    engine: SimEngine, prompt: Sequence[int], adapter_key: int, top_k: int | None
) -> list[dict[str, Any] | None] | None:
    """vLLM's `prompt_logprobs` (None unless asked): None for the first token, then the token's own entry and the
    `top_k` best, keyed by token id, each with its rank."""
    if top_k is None:
        return None
    entries: list[dict[str, Any] | None] = [None]
    for score in prompt_scores(engine, prompt, adapter_key, top_k):
        ranks = {token: rank for rank, (token, _) in enumerate(score.top, start=1)}
        entry = {str(t): {"logprob": lp, "rank": ranks[t], "decoded_token": ""} for t, lp in score.top}
        entry.setdefault(
            str(score.token), {"logprob": score.logprob, "rank": ranks.get(score.token, top_k + 1), "decoded_token": ""}
        )
        entries.append(entry)
    return entries


def sglang_input_logprobs(
    engine: SimEngine, prompt: Sequence[int], adapter_key: int, start: int, top_k: int
) -> dict[str, Any]:
    """SGLang's `input_token_logprobs` (and `input_top_logprobs` for `top_k` > 0) from `start` on: `(logprob, id,
    None)` triples, the first None (its logprob would come from the position before `start`)."""
    scores = prompt_scores(engine, prompt, adapter_key, top_k)[start:]
    out: dict[str, Any] = {
        "input_token_logprobs": [[None, prompt[start], None]] + [[s.logprob, s.token, None] for s in scores],
    }
    if top_k:
        out["input_top_logprobs"] = [None] + [[[lp, t, None] for t, lp in s.top] for s in scores]
    return out
