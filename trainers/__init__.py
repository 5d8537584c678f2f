"""A reference asynchronous GRPO trainer that learns through the gateway (`trainers.loop.train`).

Torch comes with the `trainer` extra (`pip install 'rollout-gateway[trainer]'`). The modules, each one concept:
`task` (the prompts and the reward), `rollouts` (groups of samples generated through the gateway), `grpo` (the
learner: loss, optimiser step, checkpoint) and `loop` (rollouts and learning side by side, a new weight version
posted after every step).
"""
