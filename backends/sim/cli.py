"""`rollout-gateway sim` / `python -m backends.sim`: run one simulated engine replica."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import sys
from collections.abc import Sequence

import uvicorn
import uvloop

from backends.sim.common import SimServerSettings
from backends.sim.engine import EngineSettings
from backends.sim.model import ModelShape


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rollout-gateway sim",
        description="A deterministic engine replica that speaks the vLLM or SGLang HTTP protocol.",
    )
    p.add_argument("--dialect", choices=("vllm", "sglang"), default="vllm")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001, help="0 picks a free port (printed as a JSON line)")
    g = p.add_argument_group("model")
    g.add_argument("--model-name", default="tiny", help="served model name")
    g.add_argument("--weights", default="init", help="identity of the initial weights (like a model path)")
    g.add_argument("--weight-version", default="default")
    g.add_argument("--vocab-size", type=int, default=2048)
    g.add_argument("--num-special", type=int, default=7, help="ids below this are never sampled (except EOS)")
    g.add_argument("--eos-token-id", type=int, default=2)
    g.add_argument("--eos-prob", type=float, default=0.01, help="chance that a step samples EOS")
    g.add_argument("--layers", type=int, default=2, help="MoE layers (routed experts)")
    g.add_argument("--top-k", type=int, default=2, help="experts per token")
    g.add_argument("--experts", type=int, default=8, help="experts per layer")
    g.add_argument("--max-model-len", type=int, default=4096)
    g.add_argument("--tokenizer", default=None, help="tokenizer dir or tokenizer.json for the text fields")
    s = p.add_argument_group("speed")
    s.add_argument("--token-delay", type=float, default=0.0, help="seconds per decode step")
    s.add_argument("--prefill-delay", type=float, default=0.0, help="seconds per uncached prompt token")
    s.add_argument("--block-size", type=int, default=None, help="prefix-cache block (default: vllm 16, sglang 1)")
    s.add_argument("--cache-blocks", type=int, default=65536, help="prefix-cache bound, in blocks")
    c = p.add_argument_group("capacity (any of the first three turns the capacity model on; 0: unlimited)")
    c.add_argument(
        "--max-num-seqs",
        "--max-running-requests",
        dest="max_num_seqs",
        type=int,
        default=0,
        help="requests decoded per step; the rest wait first come, first served",
    )
    c.add_argument(
        "--num-gpu-blocks", type=int, default=0, help="KV blocks per rank (prefix cache included); short: preemption"
    )
    c.add_argument("--per-seq-delay", type=float, default=0.0, help="seconds a decode step takes per running request")
    c.add_argument("--data-parallel-size", type=int, default=1, help="independent schedulers behind the one server")
    f = p.add_argument_group("features")
    f.add_argument(
        "--paused-new-requests",
        choices=("block", "reject"),
        default="block",
        help="vLLM only: new requests during an abort/wait pause block (0.32) or get 503 (0.33)",
    )
    f.add_argument("--max-loras", type=int, default=0, help="> 0: LoRA adapters loaded at run time (0: LoRA off)")
    f.add_argument("--enable-return-routed-experts", action="store_true")
    f.add_argument(
        "--enable-routed-experts-input",
        action="store_true",
        help="accept `replay_routed_experts` (a simulator extension; off like the real engines)",
    )
    f.add_argument("--no-dev-mode", action="store_true", help="vLLM: hide the dev-mode routes (/pause, ...)")
    f.add_argument("--enable-scale-out", action="store_true", help="vLLM: enable /inference/v1/generate")
    f.add_argument("--enable-prompt-tokens-details", action="store_true")
    f.add_argument("--incremental-streaming-output", action="store_true", help="SGLang: delta stream chunks")
    x = p.add_argument_group("faults")
    x.add_argument("--startup-delay", type=float, default=0.0, help="answer 503 for this long after start")
    x.add_argument("--error-rate", type=float, default=0.0, help="fraction of generate requests answered 500")
    x.add_argument("--fault-seed", type=int, default=0)
    x.add_argument("--allow-crash", action="store_true", help="let POST /sim/faults {crash} exit the process")
    x.add_argument(
        "--weights-must-exist", action="store_true", help="fail weight loads from a path that is not on disk"
    )
    p.add_argument("--log-level", default="warning")
    return p


def settings_from_args(args: argparse.Namespace) -> SimServerSettings:
    shape = ModelShape(
        vocab_size=args.vocab_size,
        num_special=args.num_special,
        eos_token_id=args.eos_token_id,
        eos_prob=args.eos_prob,
        num_layers=args.layers,
        top_k=args.top_k,
        num_experts=args.experts,
    )
    block_size = args.block_size or (16 if args.dialect == "vllm" else 1)
    engine = EngineSettings(
        model_name=args.model_name,
        weights=args.weights,
        version=args.weight_version,
        shape=shape,
        token_delay_s=args.token_delay,
        prefill_delay_s_per_token=args.prefill_delay,
        block_size=block_size,
        cache_blocks=args.cache_blocks,
        max_model_len=args.max_model_len,
        new_requests_while_paused=args.paused_new_requests,
        routed_experts_output=args.enable_return_routed_experts,
        routed_experts_input=args.enable_routed_experts_input,
        max_num_seqs=args.max_num_seqs,
        num_gpu_blocks=args.num_gpu_blocks,
        per_seq_delay_s=args.per_seq_delay,
        data_parallel_size=args.data_parallel_size,
        max_loras=args.max_loras,
    )
    return SimServerSettings(
        dialect=args.dialect,
        engine=engine,
        dev_mode=not args.no_dev_mode,
        enable_scale_out=args.enable_scale_out,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        incremental_streaming_output=args.incremental_streaming_output,
        tokenizer_path=args.tokenizer,
        startup_delay_s=args.startup_delay,
        error_rate=args.error_rate,
        fault_seed=args.fault_seed,
        weights_must_exist=args.weights_must_exist,
        allow_crash=args.allow_crash,
    )


async def serve(settings: SimServerSettings, host: str, port: int, log_level: str) -> None:
    """Serve until SIGINT/SIGTERM; print one JSON line with the bound port once listening."""
    from backends.sim.server import bind_socket, create_app

    sock = bind_socket(host, port)
    config = uvicorn.Config(
        create_app(settings), http="httptools", log_level=log_level, access_log=False, timeout_graceful_shutdown=2
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.01)  # uvicorn exposes no startup event
    if server.started:
        bound = sock.getsockname()[1]
        print(json.dumps({"event": "listening", "host": host, "port": bound, "dialect": settings.dialect}), flush=True)
    await task


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        print(f"rollout-gateway sim: {exc}", file=sys.stderr)
        return 2
    with contextlib.suppress(KeyboardInterrupt):
        uvloop.run(serve(settings, args.host, args.port, args.log_level))
    return 0
