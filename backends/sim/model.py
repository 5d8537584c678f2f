"""The simulator's deterministic "model".

Every token is a pure function of (weights key, seed, full token prefix): the prefix enters through a
rolling 64-bit hash, so a continuation re-issued with prompt + generated tokens reproduces exactly what an
uninterrupted run would have produced, at O(1) work per token. The weights key is derived from the loaded
weights' identity and the weight-version label (in RL the two always change together, so treating a label
change as a weight change lets tests see which version sampled each token). Logprobs and routed experts are
deterministic too.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from common.hashing import GOLDEN, MASK64, MUL1, MUL2, mix64, string_key

_TOKEN_SALT = 0xD6E8FEB86659FD93
PREFIX_HASH_START = 0x243F6A8885A308D3


def extend_prefix_hash(state: int, token: int) -> int:
    """The rolling hash of a prefix extended by one token."""
    return mix64(state ^ ((token + 1) * _TOKEN_SALT & MASK64))


def prefix_hashes(tokens: Iterable[int], state: int = PREFIX_HASH_START) -> list[int]:
    """Hash of every prefix: element i is the hash of tokens[: i + 1]."""
    out: list[int] = []
    for token in tokens:
        state = extend_prefix_hash(state, token)
        out.append(state)
    return out


def weights_key(weights: str, version: str) -> int:
    """The key that selects the simulated weights: identity of the loaded weights plus the version label."""
    return mix64(string_key(weights) ^ mix64(string_key(version)))


@dataclass(frozen=True, slots=True)
class ModelShape:
    """Vocabulary and MoE geometry of the simulated model."""

    vocab_size: int = 2048
    num_special: int = 7
    eos_token_id: int = 2
    eos_prob: float = 0.01
    num_layers: int = 2
    top_k: int = 2
    num_experts: int = 8

    def __post_init__(self) -> None:
        if not 0 <= self.eos_token_id < self.vocab_size:
            raise ValueError("eos_token_id must be inside the vocabulary")
        if self.num_special >= self.vocab_size:
            raise ValueError("num_special must be smaller than vocab_size")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError("top_k must be in [1, num_experts]")
        if not 0.0 <= self.eos_prob < 1.0:
            raise ValueError("eos_prob must be in [0, 1)")

    @property
    def expert_dtype(self) -> np.dtype[np.unsignedinteger]:
        """The smallest unsigned dtype that holds an expert id."""
        if self.num_experts <= 256:
            return np.dtype(np.uint8)
        if self.num_experts <= 65536:
            return np.dtype(np.uint16)
        return np.dtype(np.uint32)


@dataclass(frozen=True, slots=True)
class Draw:
    """One sampled token with its logprob and the alternatives' (token, logprob), best first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


class TokenModel:
    """Deterministic next-token, logprob and routed-expert functions."""

    def __init__(self, shape: ModelShape) -> None:
        self.shape = shape
        self._eos_threshold = int(shape.eos_prob * (1 << 53))
        self._span = shape.vocab_size - shape.num_special

    @staticmethod
    def sample_key(wkey: int, seed: int) -> int:
        """Combine the weights key with the request's seed (0 for greedy)."""
        return mix64(wkey ^ mix64(seed & MASK64))

    def draw(self, prefix_hash: int, key: int, *, allow_eos: bool, num_top: int = 0) -> Draw:
        """The token that follows the prefix whose hash is `prefix_hash`, under `key` (from `sample_key`)."""
        r = mix64(prefix_hash ^ key)
        if allow_eos and (r >> 11) < self._eos_threshold:
            token = self.shape.eos_token_id
        else:
            token = self.shape.num_special + (r % self._span)
        logprob = -(((r >> 24) % 4000) / 1000.0) - 0.001
        top: tuple[tuple[int, float], ...] = ()
        if num_top > 0:
            alts = [(token, logprob)]
            x = r
            while len(alts) < num_top:
                x = mix64(x)
                alt = self.shape.num_special + (x % self._span)
                if all(alt != t for t, _ in alts):
                    alts.append((alt, logprob - 0.25 * len(alts) - ((x >> 40) % 100) / 1000.0))
            top = tuple(alts)
        return Draw(token, logprob, top)

    def score(self, prefix_hash: int, key: int, token: int, num_top: int = 0) -> Draw:
        """What the model gives `token` after the prefix whose hash is `prefix_hash`: its logprob (that of the
        token `draw` samples, or of one of its alternatives; any other token's is below them all) and the
        `num_top` best there (a teacher scoring a sequence, `backends.sim.scoring`)."""
        draw = self.draw(prefix_hash, key, allow_eos=True, num_top=max(num_top, 1))
        for candidate, logprob in draw.top:
            if candidate == token:
                return Draw(token, logprob, draw.top[:num_top])
        floor = draw.top[-1][1] - 1.0 - (mix64(prefix_hash ^ key ^ (token + 1) * GOLDEN & MASK64) % 1000) / 1000.0
        return Draw(token, floor, draw.top[:num_top])

    def score_sequence(self, token_ids: Sequence[int], key: int, start: int, num_top: int = 0) -> list[Draw]:
        """`score` of each of `token_ids[start:]` (start ≥ 1) given the ids before it."""
        scores: list[Draw] = []
        state = PREFIX_HASH_START
        for position, token in enumerate(token_ids):
            if position >= start:
                scores.append(self.score(state, key, token, num_top))
            state = extend_prefix_hash(state, token)
        return scores

    def routed_experts(self, position_hashes: Sequence[int], wkeys: Sequence[int]) -> npt.NDArray[np.unsignedinteger]:
        """Experts chosen at each position, shape (positions, layers, top_k), in the smallest unsigned dtype.

        Position p's routing is a function of the prefix through p and of the weights it was computed under.
        """
        s = self.shape
        n = len(position_hashes)
        if n == 0:
            return np.zeros((0, s.num_layers, s.top_k), dtype=s.expert_dtype)
        base = np.array([(h ^ w) & MASK64 for h, w in zip(position_hashes, wkeys, strict=True)], dtype=np.uint64)
        layer_salt = (np.arange(1, s.num_layers + 1, dtype=np.uint64) * np.uint64(_TOKEN_SALT)) & np.uint64(MASK64)
        expert_salt = np.arange(1, s.num_experts + 1, dtype=np.uint64) * np.uint64(GOLDEN)
        scores = base[:, None, None] ^ layer_salt[None, :, None] ^ expert_salt[None, None, :]
        scores = _mix64_array(scores)
        top = np.argsort(scores, axis=2, kind="stable")[:, :, : s.top_k]
        return top.astype(s.expert_dtype)


def _mix64_array(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    with np.errstate(over="ignore"):
        z = x + np.uint64(GOLDEN)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(MUL1)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(MUL2)
        return z ^ (z >> np.uint64(31))
