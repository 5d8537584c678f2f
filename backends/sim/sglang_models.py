"""The request bodies of the simulator's SGLang dialect: the subset of SGLang's own models it honours, and the
checks SGLang makes of a body (unknown fields are a 400 there, unlike vLLM)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from backends.sim.engine import SimRequestError


class ContractError(SimRequestError):
    """A body that SGLang's API contract gate rejects before anything runs (400)."""


class SamplingParams(BaseModel):
    """`sampling/sampling_params.py` SamplingParams. Honoured: max_new_tokens, temperature, sampling_seed,
    stop_token_ids, ignore_eos, min_new_tokens, n (must be 1); the rest is accepted and has no effect."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int | None = 128
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = Field(default=0, ge=0)
    n: int = 1
    beam_width: int | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    stream_interval: int | None = None
    logit_bias: dict[str, float] | None = None
    sampling_seed: int | None = None
    custom_params: dict[str, Any] | None = None
    watermark: Any = None


class GenerateReqInput(BaseModel):
    """The subset of `managers/io_struct.py` GenerateReqInput the simulator serves; unknown fields are a 400."""

    model_config = ConfigDict(extra="forbid")

    rid: str | list[str] | None = None
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = Field(default=0, ge=0)
    token_ids_logprob: list[int] | None = None
    return_text_in_logprobs: bool = False
    return_prompt_token_ids: bool = False
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    session_id: str | None = None
    routing_key: str | None = None
    extra_key: str | None = None
    cache_salt: str | None = None
    priority: int | None = None
    custom_labels: dict[str, str] | None = None
    routed_dp_rank: int | None = None
    data_parallel_rank: int | None = None  # deprecated alias of routed_dp_rank
    lora_path: str | None = None  # the name of a loaded LoRA adapter (`backends.sim.adapters`)


class GenerateReqInputWithReplay(GenerateReqInput):
    """Simulator-only: `replay_routed_experts` (base64 raw int32 experts for prefix positions, routing replay).
    Served only by replicas started with `routed_experts_input`; elsewhere it is an unknown field like any other."""

    replay_routed_experts: str | None = None


class AbortReq(BaseModel):
    rid: str = ""
    abort_all: bool = False


class PauseGenerationReqInput(BaseModel):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueGenerationReqInput(BaseModel):
    torch_empty_cache: bool = False


class UpdateWeightFromDiskReqInput(BaseModel):
    """`load_format`, `is_async`, `torch_empty_cache`, `keep_pause`, `recapture_cuda_graph`, `token_step` and
    `manifest` are accepted for compatibility; the simulator's load is instantaneous and synchronous."""

    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
    flush_cache: bool = True
    manifest: Any = None


class UpdateWeightVersionReqInput(BaseModel):
    new_version: str
    abort_all_requests: bool = True


def check_known_fields(payload: Mapping[str, Any], model: type[BaseModel], where: str = "") -> None:
    """SGLang 0.5.23's contract gate: name the first unknown field and list the accepted ones (serde's wording)."""
    for key in payload:
        if key not in model.model_fields:
            expected = ", ".join(f"`{name}`" for name in model.model_fields)
            raise ContractError(f"unknown field `{key}`{where}, expected one of {expected}")


def validation_message(errors: Sequence[Mapping[str, Any]]) -> str:
    parts = []
    for error in errors:
        loc = ".".join(str(part) for part in error.get("loc", ()) if part != "body")
        parts.append(f"{loc}: {error.get('msg', 'invalid')}" if loc else str(error.get("msg", "invalid")))
    return "; ".join(parts) or "invalid request"


# -- metrics ----------------------------------------------------------------------------------------------------
