"""Which history a gateway runs with (`token_history_for`), on the tiny tokenizer and templates of the test's own."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from gateway.assets import TINY_TOKENIZER_DIR
from gateway.errors import ConfigError
from gateway.history import TokenHistory, family_of, token_history_for
from gateway.tokenization import ChatTokenizer
from tests.gateway.parsers.family_tokenizers import family_tokenizer_dir

TINY = ChatTokenizer.load(TINY_TOKENIZER_DIR)

# A template that writes the reasoning of every reply after it, where the next message's text goes: what follows a
# reply depends on the reply, so no suffix rule can hold.
REASONING_AFTER = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{%- if m.reasoning_content %}<|im_start|>note\n{{ m.reasoning_content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


def test_the_tiny_tokenizer_runs_in_tokens_mode() -> None:
    family = family_of(TINY.chat_template, "hermes", None)
    history = token_history_for(TINY, family, "tokens", explicit=True)
    assert family == "chatml" and isinstance(history, TokenHistory)
    assert token_history_for(TINY, family, "template", explicit=True) is None


def test_a_family_without_a_verified_rule_warns_by_default_and_refuses_when_asked_for(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert family_of(TINY.chat_template, "openai", "gpt_oss") is None
    with caplog.at_level(logging.WARNING, logger="gateway.history.verify"):
        assert token_history_for(TINY, None, "tokens", explicit=False) is None
    assert "no verified suffix rule" in caplog.text and "template mode" in caplog.text
    with pytest.raises(ConfigError, match="no verified suffix rule.*sessions.history: template"):
        token_history_for(TINY, None, "tokens", explicit=True)


def test_a_template_whose_suffix_depends_on_the_reply_is_refused(tmp_path: Path) -> None:
    tokenizer = ChatTokenizer.load(family_tokenizer_dir(tmp_path, REASONING_AFTER))
    with pytest.raises(ConfigError, match="depends on the reply's reasoning"):
        token_history_for(tokenizer, "chatml", "tokens", explicit=True)


# A template that writes a reply's reasoning after it only when the `notes` argument is set: the rule holds without
# it and not with it.
NOTES_WHEN_ASKED = REASONING_AFTER.replace("m.reasoning_content %}", "m.reasoning_content and notes %}")


def test_template_arguments_the_start_up_check_did_not_see_are_checked_once_before_tokens_follow_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tokenizer = ChatTokenizer.load(family_tokenizer_dir(tmp_path, NOTES_WHEN_ASKED))
    history = token_history_for(tokenizer, "chatml", "tokens", explicit=True)
    assert history is not None
    conversation = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello", "reasoning_content": "r"},
    ]
    new = [{"role": "user", "content": "And?"}]
    assert history.suffix_text(conversation, new, None, None) == "<|im_start|>user\nAnd?<|im_end|><|im_start|>assistant"
    assert history.suffix_text(conversation, new, None, {"notes": False}) is not None  # checked: it holds
    with caplog.at_level(logging.WARNING, logger="gateway.history.suffix"):
        assert history.suffix_text(conversation, new, None, {"notes": True}) is None  # those turns: the template's
        assert history.suffix_text(conversation, new, None, {"notes": True}) is None
    assert caplog.text.count("does not hold") == 1  # checked once
    assert history.holds_for(None) and history.holds_for({"notes": False}) and not history.holds_for({"notes": True})
