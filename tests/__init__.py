"""The project's tests, laid out as the packages they test: `tests/gateway/…` holds the tests of `gateway/…`,
`tests/backends/…` those of `backends/…`, and so on. The shared fixtures and helpers stay here at the root
(`conftest.py`, `gateway_helpers.py`, `sim_helpers.py`, …), beside the repository-wide rules (`test_layers.py`,
`test_docker_files.py`); `chaos/`, `engines/` and `fuzz/` are the cross-cutting tiers."""

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
"""The repository's root (the folder of pyproject.toml), wherever a test file lies under tests/."""
