"""Utilities shared by the gateway and the engine adapters that belong to neither: the root of the exception tree
(`common.errors.GatewayError`), ASGI helpers that notice a client's disconnect (`common.asgi`), stable 64-bit
hashing (`common.hashing`) and per-event-loop objects (`common.loop_local`).

`common` imports nothing of `gateway`, `backends`, `rollout_agents` or `trainers`; all of them may import it.
"""
