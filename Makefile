.PHONY: check test demo

check:
	scripts/check

test:
	.venv/bin/python -m pytest

demo:
	.venv/bin/rollout-gateway demo
