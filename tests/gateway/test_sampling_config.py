"""`server.api_keys` entries with ids and the `sampling:` section (issue 49 §3): what start-up accepts and refuses, the
messages that name the key without the secret, and the policy applied to a turn's sampling."""

from __future__ import annotations

import os

import orjson
import pytest
from pydantic import BaseModel

from gateway.api.anthropic.models import MessagesRequest
from gateway.api.generate.routes import GenerateSampling
from gateway.api.openai.models import ChatCompletionRequest, CompletionRequest
from gateway.api.responses.models import ResponseRequest
from gateway.api.sampling import (
    ANTHROPIC_FIELDS,
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    GENERATE_FIELDS,
    RESPONSES_FIELDS,
    ParamFields,
)
from gateway.config import SamplingPolicy, derived_key_id, load_config
from gateway.config.sampling import FORBID_ONLY, PINNABLE
from gateway.errors import ConfigError, InvalidRequest
from gateway.turns.request import Sampling
from gateway.turns.sampling_policy import governed

SECRET = "sk-secret-3e9a7c1d55b04f26"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.upper().startswith("RG_"):
            monkeypatch.delenv(name)


def config_error(**overrides: object) -> str:
    with pytest.raises(ConfigError) as raised:
        load_config(**overrides)
    return raised.value.message


def test_a_key_alone_is_named_by_a_digest_and_an_entry_by_its_id(monkeypatch: pytest.MonkeyPatch) -> None:
    keys = [SECRET, {"id": "team-a", "key": "sk-team"}]
    monkeypatch.setenv("RG_SERVER__API_KEYS", orjson.dumps(keys).decode())
    settings = load_config(sampling={"keys": {"team-a": {"seed": "forbid"}, derived_key_id(SECRET): {}}})
    alone, named = settings.server.api_keys
    assert (alone.id, alone.secret()) == (derived_key_id(SECRET), SECRET)
    assert alone.id.startswith("key-") and len(alone.id) == 20 and SECRET not in alone.id
    assert (named.id, named.secret()) == ("team-a", "sk-team")
    assert settings.sampling.policy_for("team-a").seed == "forbid"
    assert settings.sampling.policy_for("key-unknown") == settings.sampling.default
    assert SECRET not in repr(settings) and SECRET not in settings.model_dump_json()
    assert hash(settings) == hash(load_config(sampling={"keys": {"team-a": {"seed": "forbid"}, alone.id: {}}}))


@pytest.mark.parametrize(
    ("keys", "expected"),
    [
        ([SECRET, SECRET], f"the key id '{derived_key_id(SECRET)}' is given 2 times"),
        ([{"id": "a", "key": SECRET}, {"id": "b", "key": SECRET}], "the keys 'a' and 'b' are the same secret"),
        ([{"id": "anonymous", "key": SECRET}], "'anonymous' is reserved"),
        ([{"id": "team a", "key": SECRET}], "server.api_keys[0].id: String should match pattern"),
        ([{"id": "a", "key": " "}], "server.api_keys[0].key: an API key must not be empty"),
        ([{"id": "a", "key": SECRET, "pool": "x"}], "server.api_keys[0].pool: unknown key"),
    ],
)
def test_bad_keys_are_refused_without_their_secret(keys: list[object], expected: str) -> None:
    message = config_error(server={"api_keys": keys})
    assert expected in message
    assert SECRET not in message


def test_sampling_keys_must_name_configured_keys() -> None:
    message = config_error(server={"api_keys": [{"id": "team-a", "key": SECRET}]}, sampling={"keys": {"team-b": {}}})
    assert "sampling.keys names 'team-b', which server.api_keys does not (its key ids: team-a" in message
    assert SECRET not in message


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ({"temperature": "pinned"}, "sampling.default.temperature: must be allow, forbid or {pin: <value>}"),
        ({"top_p": {"pin": 0}}, "sampling.default.top_p: must be allow, forbid or {pin: <value>} (pin: Input should"),
        ({"seed": {"pin": 1, "value": 2}}, "(value: Extra inputs are not permitted)"),
        ({"n": {"pin": 2}}, "sampling.default.n: Input should be 'allow' or 'forbid'"),
        ({"max_tokens": {"pin": 9}, "max_tokens_cap": 8}, "max_tokens is pinned to 9, above max_tokens_cap 8"),
        ({"max_tokens_cap": 40000}, "sampling.default lets max_tokens reach 40000, above server.max_tokens_limit"),
        ({"max_tokens": {"pin": 40000}}, "sampling.default lets max_tokens reach 40000"),
        ({"repetition_penalty": "forbid"}, "sampling.default.repetition_penalty: unknown key"),
    ],
)
def test_bad_policies_name_their_key(policy: dict[str, object], expected: str) -> None:
    assert expected in config_error(sampling={"default": policy})


def test_every_policy_field_is_one_a_route_takes_and_the_routes_fields_are_their_models() -> None:
    tables: list[tuple[ParamFields, type[BaseModel]]] = [
        (CHAT_FIELDS, ChatCompletionRequest),
        (COMPLETION_FIELDS, CompletionRequest),
        (ANTHROPIC_FIELDS, MessagesRequest),
        (RESPONSES_FIELDS, ResponseRequest),
        (GENERATE_FIELDS, GenerateSampling),
    ]
    fields = set(PINNABLE) | set(FORBID_ONLY)
    assert fields == set(SamplingPolicy.model_fields) - {"max_tokens_cap"}
    assert set(CHAT_FIELDS.values()) == fields  # the chat route takes every one
    for table, model in tables:
        assert set(table) <= set(model.model_fields), model
        assert set(table.values()) <= fields, model


def test_pins_then_the_cap_apply_to_a_turns_sampling() -> None:
    asked = Sampling(max_tokens=None, temperature=0.9, stop=("a",), seed=4)
    policy = SamplingPolicy.model_validate(
        {"temperature": {"pin": 0.3}, "stop": {"pin": ["x", "y"]}, "seed": {"pin": None}, "max_tokens_cap": 16}
    )
    used = governed(policy, asked, {"temperature": "temperature"}, "sampling.default")
    assert used == Sampling(max_tokens=16, temperature=0.3, stop=("x", "y"), seed=None)
    assert governed(policy, Sampling(max_tokens=8), {}, "sampling.default").max_tokens == 8
    capped_pin = SamplingPolicy.model_validate({"max_tokens": {"pin": 12}, "max_tokens_cap": 16})
    assert governed(capped_pin, Sampling(max_tokens=100), {}, "here").max_tokens == 12
    assert governed(SamplingPolicy(), asked, {"temperature": "temperature"}, "here") is asked


def test_a_forbidden_field_names_the_parameter_and_the_policy() -> None:
    policy = SamplingPolicy.model_validate({"max_tokens": "forbid"})
    with pytest.raises(InvalidRequest) as raised:
        governed(policy, Sampling(max_tokens=3), {"max_tokens": "max_output_tokens"}, "sampling.keys.team-a")
    assert raised.value.param == "max_output_tokens" and raised.value.code == "sampling_param_forbidden"
    assert "sampling.keys.team-a.max_tokens is forbid" in raised.value.message
