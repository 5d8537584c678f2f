"""The request bodies of the simulator's vLLM dialect: the subset of vLLM's own models it honours (unknown fields
are ignored, as vLLM does)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

_CACHE_SALT_FORBIDDEN = ("@", "/", "\\", "\0")


def _checked_salt(salt: str | None) -> str | None:
    """vLLM's rule for `cache_salt` (`validate_cache_salt`): non-empty, at most 128 characters, none of @ / \\ NUL."""
    if salt is None:
        return None
    if not salt:
        raise ValueError("Parameter 'cache_salt' must be a non-empty string if provided.")
    if len(salt) > 128 or any(c in salt for c in _CACHE_SALT_FORBIDDEN):
        raise ValueError(
            "Parameter 'cache_salt' must be at most 128 characters and must not contain '@', '/', '\\\\', or NUL."
        )
    return salt


CacheSalt = Annotated[str | None, AfterValidator(_checked_salt)]


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class CompletionRequest(BaseModel):
    """The subset of vLLM's CompletionRequest the simulator honours; unknown fields are ignored like vLLM does."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: list[int] | list[list[int]] | str | list[str]
    max_tokens: int | None = 16
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    # Accepted and logged (`/sim/sampling_log`), with no effect on what the simulator samples.
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: int | None = Field(default=None, ge=0)
    prompt_logprobs: int | None = Field(default=None, ge=0)
    echo: bool = False
    request_id: str | None = None
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    return_weight_versions: bool | None = None
    routed_experts_prompt_start: int = Field(default=0, ge=0)
    replay_routed_experts: str | None = None
    cache_salt: CacheSalt = None


class GenerateSamplingParams(BaseModel):
    model_config = ConfigDict(extra="allow")

    routed_experts_prompt_start: int = Field(default=0, ge=0)
    max_tokens: int | None = 16
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    # Accepted and logged (`/sim/sampling_log`), with no effect on what the simulator samples.
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: int | None = Field(default=None, ge=0)


class GenerateRequest(BaseModel):
    """vLLM's token-in/token-out `/inference/v1/generate` body."""

    model_config = ConfigDict(extra="allow")

    request_id: str | None = None
    token_ids: list[int] = Field(min_length=1)
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = None
    output_mode: Literal["tokens", "text", "derender"] = "tokens"
    replay_routed_experts: str | None = None
    cache_salt: CacheSalt = None


class AbortRequests(BaseModel):
    request_ids: list[str] | None = None


class CollectiveRpc(BaseModel):  # type: ignore[no-redef]  # plugin: field alias "kwargs"
    method: str
    args: list[Any] = Field(default_factory=list)
    # Named with an alias: the pydantic mypy plugin clashes with a field literally called `kwargs`.
    call_kwargs: dict[str, Any] = Field(default_factory=dict, alias="kwargs")
    timeout: float | None = None


class UpdateWeightVersion(BaseModel):
    new_version: str
