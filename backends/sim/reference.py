"""What the simulator produces, computed offline: the reference that tests compare real runs against."""

from __future__ import annotations

from collections.abc import Sequence

from backends.sim.adapters import adapter_key
from backends.sim.model import PREFIX_HASH_START, Draw, ModelShape, TokenModel, extend_prefix_hash, weights_key

Weights = tuple[str, str]  # (weights identity, version label)


def reference_tokens(
    shape: ModelShape,
    prompt: Sequence[int],
    weights: Weights | Sequence[Weights],
    max_tokens: int,
    *,
    seed: int = 0,
    temperature: float = 0.0,
    ignore_eos: bool = False,
    stop_token_ids: Sequence[int] = (),
    min_tokens: int = 0,
    adapter_path: str | None = None,
) -> list[int]:
    """Tokens an uninterrupted request would get. `weights` is one (identity, version) pair, or one per output
    token (the weights that sampled it), to check a run that crossed weight updates; `adapter_path`: under the
    LoRA adapter loaded from there (`backends.sim.adapters`)."""
    lora = 0 if adapter_path is None else adapter_key(adapter_path)
    model = TokenModel(shape)
    effective_seed = 0 if temperature == 0 else seed
    per_token: list[Weights] = _per_token(weights, max_tokens)
    state = PREFIX_HASH_START
    for token in prompt:
        state = extend_prefix_hash(state, token)
    out: list[int] = []
    for i in range(min(max_tokens, len(per_token))):
        identity, version = per_token[i]
        key = model.sample_key(weights_key(identity, version) ^ lora, effective_seed)
        allow_eos = not ignore_eos and i >= min_tokens
        token = model.draw(state, key, allow_eos=allow_eos).token
        out.append(token)
        state = extend_prefix_hash(state, token)
        if (allow_eos and token == shape.eos_token_id) or (token in stop_token_ids and i + 1 >= min_tokens):
            break
    return out


def reference_scores(
    shape: ModelShape,
    token_ids: Sequence[int],
    weights: Weights,
    start: int,
    *,
    top_k: int = 0,
    adapter_path: str | None = None,
) -> list[Draw]:
    """What an engine running `weights` (under the adapter loaded from `adapter_path`) answers a teacher's scoring of
    `token_ids[start:]`: each token's logprob given the ids before it, with the `top_k` best there."""
    lora = 0 if adapter_path is None else adapter_key(adapter_path)
    model = TokenModel(shape)
    return model.score_sequence(token_ids, model.sample_key(weights_key(*weights) ^ lora, 0), start, top_k)


def _per_token(weights: Weights | Sequence[Weights], max_tokens: int) -> list[Weights]:
    if len(weights) == 2 and isinstance(weights[0], str) and isinstance(weights[1], str):
        return [(weights[0], weights[1])] * max_tokens
    return [(str(w[0]), str(w[1])) for w in weights]
