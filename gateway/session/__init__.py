"""A session (one agent episode) and its parts: who it is (identity), its samples and the one a turn extends,
the turn lifecycle (lock, load, save, finish), per-key quotas and the Responses records of its answers."""
