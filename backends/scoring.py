"""Prompt scoring: an engine's log-probability of each token of a sequence given the tokens before it. A teacher
scores a student's sample this way (on-policy distillation, docs/architecture.md §5, "Teachers"): one prefill over the
sample's ids, nothing generated.

vLLM: `POST /v1/completions` with the ids as the prompt, `prompt_logprobs: k` and `max_tokens: 1`. Its
`prompt_logprobs` holds one entry per prompt token (None for the first), a map from token id to `{logprob, rank}`
with the prompt's own token and the k best. A prompt-logprob request bypasses the prefix cache: a full prefill.
SGLang: `POST /generate` with `input_ids`, `max_new_tokens: 0`, `return_logprob`, `logprob_start_len` and
`top_logprobs_num: k`. Its `meta_info.input_token_logprobs` are `(logprob, token id, text)` triples from
`logprob_start_len` on, the first None (that position's logprob would come from the one before it), so a score
from `start` asks from `start - 1`; `input_top_logprobs` the k best at each, alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
import numpy as np
import numpy.typing as npt

from backends.base import translate_errors
from backends.errors import BackendProtocolError
from backends.http_client import ReplicaClient, request_json

__all__ = ["PromptScorer", "PromptScores"]

F32, I32 = np.dtype("<f4"), np.dtype("<i4")


@dataclass(frozen=True, slots=True)
class PromptScores:
    """`logprobs[i]`: the log-probability of token `start + i` of the scored ids given those before it; `top_ids`
    and `top_logprobs` (shape (n, k), best first): the k most likely tokens at each of those positions."""

    logprobs: npt.NDArray[np.float32]
    top_ids: npt.NDArray[np.int32]
    top_logprobs: npt.NDArray[np.float32]

    def __len__(self) -> int:
        return len(self.logprobs)


class PromptScorer:
    """One engine's scoring calls, in its dialect, through the replica's pooled client."""

    def __init__(
        self,
        client: ReplicaClient,
        replica: str,
        dialect: Literal["vllm", "sglang"],
        model: str,
        timeout: aiohttp.ClientTimeout,
    ) -> None:
        self._client, self._replica, self._dialect, self._model, self._timeout = (
            client,
            replica,
            dialect,
            model,
            timeout,
        )

    async def score(
        self, token_ids: Sequence[int], start: int, top_k: int = 0, adapter: str | None = None
    ) -> PromptScores:
        """The scores of `token_ids[start:]` (1 ≤ `start` < len), each given all the ids before it; `adapter`: under
        that LoRA adapter the engine holds (None: its own model)."""
        if not 1 <= start < len(token_ids):
            raise ValueError(f"start must be in [1, {len(token_ids)}), got {start}")
        if self._dialect == "vllm":
            return await self._vllm(token_ids, start, top_k, adapter)
        return await self._sglang(token_ids, start, top_k, adapter)

    async def _vllm(self, token_ids: Sequence[int], start: int, top_k: int, adapter: str | None) -> PromptScores:
        body = {
            "model": adapter or self._model,
            "prompt": list(token_ids),
            "max_tokens": 1,
            "temperature": 0,
            "prompt_logprobs": top_k,
        }
        answer = await self._post("/v1/completions", body)
        with translate_errors(self._replica):
            entries = answer["choices"][0]["prompt_logprobs"]
            if entries is None or len(entries) != len(token_ids):
                raise self._misaligned(len(token_ids), entries)
            scored = entries[start:]
            own = [float(entry[str(token)]["logprob"]) for entry, token in zip(scored, token_ids[start:], strict=True)]
            tops = [_best(((int(t), float(v["logprob"])) for t, v in entry.items()), top_k) for entry in scored]
        return _scores(own, tops, top_k)

    async def _sglang(self, token_ids: Sequence[int], start: int, top_k: int, adapter: str | None) -> PromptScores:
        body: dict[str, Any] = {
            "input_ids": list(token_ids),
            "sampling_params": {"max_new_tokens": 0, "temperature": 0},
            "return_logprob": True,
            "logprob_start_len": start - 1,
        }
        if top_k:
            body["top_logprobs_num"] = top_k
        if adapter is not None:
            body["lora_path"] = adapter
        answer = await self._post("/generate", body)
        with translate_errors(self._replica):
            meta = answer["meta_info"]
            entries = meta["input_token_logprobs"][1:]
            if len(entries) != len(token_ids) - start:
                raise self._misaligned(len(token_ids) - start + 1, meta["input_token_logprobs"])
            own = [float(entry[0]) for entry in entries]
            tops: list[list[tuple[int, float]]] = []
            if top_k:
                tops = [_best(((int(e[1]), float(e[0])) for e in at), top_k) for at in meta["input_top_logprobs"][1:]]
        return _scores(own, tops, top_k)

    async def _post(self, path: str, body: dict[str, Any]) -> Any:
        return await request_json(self._client, self._replica, "POST", path, json=body, timeout=self._timeout)

    def _misaligned(self, expected: int, entries: Any) -> BackendProtocolError:
        got = "none" if entries is None else str(len(entries))
        return BackendProtocolError(
            f"replica {self._replica}: {got} prompt logprobs for {expected} positions", replica=self._replica
        )


def _best(pairs: Any, k: int) -> list[tuple[int, float]]:
    return sorted(pairs, key=lambda pair: -pair[1])[:k]


def _scores(own: list[float], tops: list[list[tuple[int, float]]], top_k: int) -> PromptScores:
    n = len(own)
    top_ids = np.zeros((n, top_k), I32)
    top_logprobs = np.full((n, top_k), -np.inf, F32)
    for row, best in enumerate(tops):
        for column, (token, logprob) in enumerate(best):
            top_ids[row, column], top_logprobs[row, column] = token, logprob
    return PromptScores(np.asarray(own, F32), top_ids, top_logprobs)
