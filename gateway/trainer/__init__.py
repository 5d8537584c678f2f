"""The trainer's side of the trajectory stream: pull finished sessions from Redis, acknowledge them, tensorize.

A trainer installs this package (`pip install 'rollout-gateway[trainer]'`) and talks only to Redis; no gateway
process is involved. It reads the schema that gateway/store/keys.py documents (keys from `Keys`):

```python
async with TrajectoryConsumer(url, group="grpo", consumer=f"rank{rank}", group_by="group_id") as source:
    while training:
        batch = await source.next_batch(256, timeout=30.0)
        step(batch.to_tensors(pad_token_id=tok.pad_token_id, device="cuda"))
        await source.ack(batch)
```

One module per concept: `consumer` (delivery through a consumer group, reclaiming, acknowledging), `entries`
(what a stream entry becomes), `groups` (GRPO group assembly), `batch` (`Batch`, staleness, `to_tensors`),
`packing` (the packed layout: one row per trajectory, each token its samples share once, a tree attention mask).
"""

from __future__ import annotations

from gateway.trainer.batch import Batch, Layout, StalePolicy
from gateway.trainer.consumer import TrajectoryConsumer

__all__ = ["Batch", "Layout", "StalePolicy", "TrajectoryConsumer"]
