"""The tiny reasoning tool agent the engine tiers load for the token-native history (issue: one sample per episode):
the tiny tokenizer dressed as Qwen3 (its think tags as added tokens in the tiny tokenizer's own ids, the Qwen3-style
chat template of the tests, tests/gateway/parsers/templates/qwen3.jinja) and a tiny Qwen2 model of the dense models'
shape (an engine serving `dense` loads it as a weight update) trained here, in under a minute on a CPU, to answer as
a reasoning agent does: after a user message a think block and a tool call, after a tool result a think block and an
answer. A model that never writes a think block or a call cannot pass the tests built on it.

It is trained on both prompts an agent's turns get: the template's rendering of the conversation (the earlier
reasoning dropped, as Qwen3's template does) and the gateway's token-native history (the sampled ids, reasoning
included, then what the template writes after a reply: `gateway.history.TokenHistory`), so it answers alike in
either history mode. `build_think_model` checks that greedy decoding gives the trained answers before it saves.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
TINY_TOKENIZER = REPO_ROOT / "gateway" / "assets" / "tiny_tokenizer"
TEMPLATE = REPO_ROOT / "tests" / "gateway" / "parsers" / "templates" / "qwen3.jinja"
THINK_TAGS = ("<think>", "</think>")  # Qwen's: added tokens that are not special

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
QUESTIONS = (
    "What is the weather in Paris?",
    "Is it warm in Paris today?",
    "Paris weather, please.",
    "Should I take an umbrella in Paris?",
    "How cold is Paris right now?",
    "Tell me the weather in Paris.",
)
FOLLOW_UPS = ("And tomorrow?", "What about tonight?", "Check again, please.", "And the day after?")
RESULTS = ("18 C, sunny", "12 C, rain", "9 C, cloudy", "21 C, clear", "15 C, windy")
CALL = (
    '<think>\nI should look it up.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    "</tool_call>"
)
ANSWER = "<think>\nThe tool answered.\n</think>\n\nHere is the weather."
END = "<|im_end|>"


def think_tokenizer(folder: Path) -> Path:
    """The tiny tokenizer with Qwen3's think tags and the Qwen3-style template, saved to `folder`, in the tiny
    tokenizer's 2,048 ids: the tags take the ids of two byte tokens no text has (bytes 0xFE and 0xFF never occur
    in UTF-8), so the model has the dense models' shape and an engine serving `dense` loads it as a weight update.
    `<tool_call>` and `</tool_call>` are the tiny tokenizer's own."""
    from transformers import PreTrainedTokenizerFast

    config = json.loads((TINY_TOKENIZER / "tokenizer.json").read_text())
    vocab = config["model"]["vocab"]
    for tag, byte in zip(THINK_TAGS, (0xFE, 0xFF), strict=True):
        token_id = vocab.pop(_byte_char(byte))
        entry = {"id": token_id, "content": tag, "single_word": False, "lstrip": False, "rstrip": False}
        config["added_tokens"].append({**entry, "normalized": False, "special": False})
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(config, ensure_ascii=False))
    base = json.loads((TINY_TOKENIZER / "tokenizer_config.json").read_text())
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(folder / "tokenizer.json"),
        eos_token=base["eos_token"],
        pad_token=base["pad_token"],
        additional_special_tokens=base["additional_special_tokens"],
    )
    tokenizer.chat_template = TEMPLATE.read_text()
    tokenizer.save_pretrained(str(folder))
    return folder


def _byte_char(byte: int) -> str:
    """The character byte-level BPE writes for `byte` (GPT-2's table: printable bytes as themselves, the others
    from U+0100 on, in order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    if byte in printable:
        return chr(byte)
    return chr(256 + sorted(set(range(256)) - set(printable)).index(byte))


def episodes(folder: Path, count: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """`count` three-turn episodes (a call, an answer after its result, a call after a follow-up question), each
    as ids and a loss mask (1 on the replies and their end token), in both histories."""
    from gateway.history import TokenHistory
    from gateway.tokenization import ChatTokenizer

    tokenizer = ChatTokenizer.load(folder)
    history = TokenHistory(tokenizer, "chatml")
    rng = random.Random(seed)
    out = []
    for index in range(count):
        messages: list[dict[str, Any]] = [{"role": "user", "content": rng.choice(QUESTIONS)}]
        function = {"name": "get_weather", "arguments": {"city": "Paris"}}
        calls = [{"id": "call0", "type": "function", "function": function}]
        turns = [
            (CALL, {"role": "assistant", "content": "", "tool_calls": calls}),  # the agent sends no reasoning back
            (ANSWER, {"role": "assistant", "content": "Here is the weather."}),
            (CALL, {"role": "assistant", "content": "", "tool_calls": calls}),
        ]
        added = [
            [{"role": "tool", "tool_call_id": "call0", "content": rng.choice(RESULTS)}],
            [{"role": "user", "content": rng.choice(FOLLOW_UPS)}],
        ]
        token_native = index % 2 == 0
        text_parts: list[tuple[str, int]] = [(tokenizer.render_text(messages, TOOLS, True), 0)]
        for turn, (reply, message) in enumerate(turns):
            if turn and not token_native:  # the template renders the whole conversation again
                text_parts = [(tokenizer.render_text(messages, TOOLS, True), 0)]
            text_parts.append((reply + END, 1))
            if turn < len(added):
                if token_native:
                    suffix = history.suffix_text([*messages, message], added[turn], TOOLS, None)
                    assert suffix is not None
                    text_parts.append((suffix, 0))
                messages = [*messages, message, *added[turn]]
            if not token_native or turn == len(turns) - 1:
                out.append(_encoded(tokenizer, text_parts))
    return out


def _encoded(tokenizer: Any, parts: list[tuple[str, int]]) -> tuple[list[int], list[int]]:
    ids: list[int] = []
    mask: list[int] = []
    for text, trained in parts:
        piece = tokenizer.encode(text)
        ids += piece
        mask += [trained] * len(piece)
    return ids, mask


def build_think_model(out: Path, common: dict[str, Any], dtype: str, *, steps: int = 300, seed: int = 5) -> Path:
    """Train the agent into `out/think` (and the same weights into `out/think_v2`, for weight updates)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    target = out / "think"
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    think_tokenizer(target)
    data = episodes(target, 96, seed)
    torch.manual_seed(seed)
    config = Qwen2Config(**{**common, "initializer_range": 0.02})  # the dense models' shape, vocabulary included
    model = Qwen2ForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 20))
    rng = random.Random(seed)
    model.train()
    for _ in range(steps):
        batch = rng.sample(data, 8)
        width = max(len(ids) for ids, _ in batch)
        ids = torch.tensor([i + [0] * (width - len(i)) for i, _ in batch])
        mask = torch.tensor([m + [0] * (width - len(m)) for _, m in batch])
        hidden = model.model(input_ids=ids).last_hidden_state[:, :-1]
        trained = mask[:, 1:].bool()  # the logits of the trained tokens only: most of a step's cost otherwise
        loss = torch.nn.functional.cross_entropy(model.lm_head(hidden[trained]), ids[:, 1:][trained])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        warmup.step()
    model.eval()
    _check_greedy(model, target)
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(target, safe_serialization=True)
    generation = {"bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 0, "do_sample": False}
    (target / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    second = out / "think_v2"
    if second.exists():
        shutil.rmtree(second)
    shutil.copytree(target, second)
    return target


def _check_greedy(model: Any, folder: Path) -> None:
    """Greedy decoding answers a new episode as trained, in both histories: else the build fails."""
    import torch

    from gateway.tokenization import ChatTokenizer

    tokenizer = ChatTokenizer.load(folder)
    for ids, mask in episodes(folder, 4, seed=1234):
        starts = [i for i in range(1, len(mask)) if mask[i] and not mask[i - 1]]
        for start in starts:
            end = next((i for i in range(start, len(mask)) if not mask[i]), len(mask))
            with torch.no_grad():
                generated = model.generate(
                    torch.tensor([ids[:start]]), max_new_tokens=end - start, do_sample=False, eos_token_id=2
                )[0, start:].tolist()
            if generated != ids[start:end]:
                raise RuntimeError(
                    f"the think model did not learn its answers: {tokenizer.decode(generated)!r} "
                    f"instead of {tokenizer.decode(ids[start:end])!r}"
                )
