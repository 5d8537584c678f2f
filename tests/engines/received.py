"""The prompts an engine server logged it received, read back from its log (`EngineLaunch.log_received_prompts`):
the tiers' proof that the prompt the gateway stored for a turn is the one the engine got, as the engine saw it.

vLLM (`--enable-log-requests`, its request logger alone at DEBUG) writes a line per request, its id the gateway's
with the route's prefix (`generate-tokens-<id>`, `cmpl-<id>-0`):

    (APIServer pid=…) DEBUG 12-06 06:47:41 [request_logger.py:55] Request generate-tokens-<id> details:
    prompt: None, prompt_token_ids: [1, 89, 1176, …], prompt_embeds shape: None.   (one line in the log)

SGLang (`--log-requests --log-requests-level 2 --log-requests-format json`) a JSON object per received request, its
`rid` the gateway's id:

    [2026-12-06 06:51:33] {"timestamp": …, "event": "request.received", "rid": "<id>", "obj": {"input_ids": […], …}}
"""

from __future__ import annotations

import json
import re

from tests.engines.servers import EngineServer

__all__ = ["received_prompts"]

_VLLM = re.compile(r"Request (\S+) details: prompt: .*?, prompt_token_ids: \[([0-9, ]*)\], prompt_embeds shape: ")
_SGLANG_EVENT = '"event": "request.received"'


def received_prompts(server: EngineServer) -> list[tuple[str, list[int] | None]]:
    """Each request `server` logged it received, oldest first: its engine request id and its prompt ids (a prompt
    past `RECEIVED_PROMPT_LOG_IDS` ids is logged cut, so it equals no stored prompt; None: SGLang got text, as its
    own warm-up request)."""
    assert server.log is not None and server.logs_received_prompts, f"{server.kind} logs no received prompts"
    text = server.log.read_text(errors="replace")
    if server.kind == "vllm":
        return [(m[1], [int(i) for i in m[2].split(",") if i.strip()]) for m in _VLLM.finditer(text)]
    received: list[tuple[str, list[int] | None]] = []
    for line in text.splitlines():
        if _SGLANG_EVENT in line:
            event = json.loads(line[line.index("{") :])
            received.append((event["rid"], event["obj"]["input_ids"]))
    return received
