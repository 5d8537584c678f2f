#!/usr/bin/env python3
"""Build the tiny byte-level BPE tokenizer used by the tests and the demo.

The tokenizer is trained locally, with no network access, on a deterministic, sorted selection of the running
Python's standard-library ``.py`` files (capped in total size so training takes a few seconds). It has a total
vocabulary of ``VOCAB_SIZE`` entries, including these added tokens with fixed ids::

    0 <|endoftext|>    (pad)
    1 <|im_start|>
    2 <|im_end|>       (eos)
    3 <tool_call>
    4 </tool_call>
    5 <tool_response>
    6 </tool_response>

The result is wrapped as a ``transformers.PreTrainedTokenizerFast`` with a Qwen2.5-style ChatML chat template that
supports tools, and written with ``save_pretrained`` (default: ``gateway/assets/tiny_tokenizer/``).

The output is a pure function of the corpus, so running the script twice with the same Python gives identical
files. A different Python version has a different standard library and therefore gives different merges.

Usage::

    python scripts/build_tokenizer.py [--out DIR] [--max-bytes N] [--vocab-size N]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Keep the tokenizers thread pool out of the way of any later fork, and make sure nothing is fetched from a hub.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "gateway" / "assets" / "tiny_tokenizer"

VOCAB_SIZE = 2048  # total, added tokens included; must stay <= 4096
MAX_VOCAB_SIZE = 4096
DEFAULT_MAX_BYTES = 2_000_000  # corpus cap; keeps training to a few seconds
MAX_FILE_BYTES = 200_000  # skip huge generated files (they would dominate the corpus)
MODEL_MAX_LENGTH = 131072

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TOOL_CALL = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
TOOL_RESPONSE = "<tool_response>"
TOOL_RESPONSE_END = "</tool_response>"

# Order == id.
ADDED_TOKENS: tuple[str, ...] = (
    ENDOFTEXT,
    IM_START,
    IM_END,
    TOOL_CALL,
    TOOL_CALL_END,
    TOOL_RESPONSE,
    TOOL_RESPONSE_END,
)
# Control tokens, dropped by ``decode(..., skip_special_tokens=True)``. The tool tags are ordinary added tokens (as in
# Qwen2.5) so that tool calls survive a decode that skips special tokens.
SPECIAL_TOKENS: frozenset[str] = frozenset({ENDOFTEXT, IM_START, IM_END})

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."

# Qwen2.5-style ChatML template with tool support. Differences from the original: a neutral default system prompt,
# and ``arguments`` given as a JSON string (OpenAI wire format) are emitted verbatim instead of being re-encoded.
CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- '__DEFAULT_SYSTEM_PROMPT__' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n" }}
    {{- "You are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within " }}
    {{- "<tool_call></tool_call> XML tags:\n<tool_call>\n" }}
    {{- '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\n__DEFAULT_SYSTEM_PROMPT__<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first)
            or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + (message.content or '') + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {%- if tool_call.arguments is string %}
                {{- tool_call.arguments }}
            {%- else %}
                {{- tool_call.arguments | tojson }}
            {%- endif %}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
""".replace("__DEFAULT_SYSTEM_PROMPT__", DEFAULT_SYSTEM_PROMPT)


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def select_corpus_files(root: Path, max_bytes: int) -> list[Path]:
    """Deterministic, sorted selection of stdlib ``.py`` files whose total size stays within ``max_bytes``.

    Walks the standard library in sorted relative-path order, skipping tests, vendored ``site-packages`` and
    oversized files, and stops once the cap is reached.
    """
    excluded_parts = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    candidates = sorted(
        (p for p in root.rglob("*.py") if p.is_file() and not excluded_parts.intersection(p.relative_to(root).parts)),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    selected: list[Path] = []
    total = 0
    for path in candidates:
        size = path.stat().st_size
        if size == 0 or size > MAX_FILE_BYTES:
            continue
        if total + size > max_bytes:
            break
        selected.append(path)
        total += size
    return selected


def iter_texts(files: list[Path]) -> Iterator[str]:
    for path in files:
        yield path.read_bytes().decode("utf-8", errors="replace")


def train_tokenizer(files: list[Path], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,  # includes the special tokens, which get ids 0.. in order
        min_frequency=2,
        special_tokens=list(ADDED_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(iter_texts(files), trainer=trainer, length=len(files))

    # The trainer registers every added token as special; the tool tags should be ordinary added tokens.
    spec = json.loads(tokenizer.to_str())
    for entry in spec["added_tokens"]:
        entry["special"] = entry["content"] in SPECIAL_TOKENS
    return Tokenizer.from_str(json.dumps(spec))


def check_tokenizer(tokenizer: Tokenizer) -> None:
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size > MAX_VOCAB_SIZE:
        raise SystemExit(f"vocabulary too large: {size} > {MAX_VOCAB_SIZE}")
    for expected_id, token in enumerate(ADDED_TOKENS):
        got = tokenizer.token_to_id(token)
        if got != expected_id:
            raise SystemExit(f"{token!r} has id {got}, expected {expected_id}")
    sample = "héllo — 你好 🙂\n\tdef f(x): return x  # ok"
    if tokenizer.decode(tokenizer.encode(sample).ids, skip_special_tokens=False) != sample:
        raise SystemExit("round-trip check failed")


def save(tokenizer: Tokenizer, out: Path) -> list[Path]:
    from transformers import PreTrainedTokenizerFast

    fast_cls: Any = PreTrainedTokenizerFast  # untyped in transformers 5
    fast = fast_cls(
        tokenizer_object=tokenizer,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=None,
        bos_token=None,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,
        padding_side="left",
    )
    fast.chat_template = CHAT_TEMPLATE
    out.mkdir(parents=True, exist_ok=True)
    written = fast.save_pretrained(str(out))
    _make_config_portable(out / "tokenizer_config.json", CHAT_TEMPLATE)
    return sorted({Path(p) for p in written if Path(p).exists()})


def _make_config_portable(path: Path, chat_template: str) -> None:
    """Rewrite ``tokenizer_config.json`` so transformers 4.x (used by vLLM/SGLang images) loads it as well as 5.x.

    transformers 5 records its own backend class name, renames ``additional_special_tokens`` and keeps the chat
    template only in ``chat_template.jinja``; the spellings below are the pre-5 ones, which 5.x still accepts.
    Keys are sorted so the file is stable and diffs stay reviewable.
    """
    config = json.loads(path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    # Older 4.x releases only read the template from here; newer ones prefer chat_template.jinja (same text).
    config["chat_template"] = chat_template
    extra = config.pop("extra_special_tokens", None)
    if extra:
        config["additional_special_tokens"] = extra
    path.write_text(json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output directory (default: {DEFAULT_OUT})")
    parser.add_argument(
        "--max-bytes",
        type=int,
        default=DEFAULT_MAX_BYTES,
        help=f"cap on total corpus size in bytes (default: {DEFAULT_MAX_BYTES})",
    )
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE, help=f"total vocabulary (default: {VOCAB_SIZE})")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not len(ADDED_TOKENS) < args.vocab_size <= MAX_VOCAB_SIZE:
        raise SystemExit(f"--vocab-size must be in ({len(ADDED_TOKENS)}, {MAX_VOCAB_SIZE}]")
    started = time.perf_counter()
    root = stdlib_dir()
    files = select_corpus_files(root, args.max_bytes)
    if not files:
        raise SystemExit(f"no .py files found under {root}")
    corpus_bytes = sum(p.stat().st_size for p in files)
    tokenizer = train_tokenizer(files, args.vocab_size)
    check_tokenizer(tokenizer)
    written = save(tokenizer, args.out)
    elapsed = time.perf_counter() - started
    print(
        f"trained on {len(files)} files ({corpus_bytes} bytes) from {root}; "
        f"vocab {tokenizer.get_vocab_size(with_added_tokens=True)}; {elapsed:.1f}s",
        file=sys.stderr,
    )
    for path in written:
        print(f"  {path} ({path.stat().st_size} bytes)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
