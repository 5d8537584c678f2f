"""The import rules between the project's layers (docs/architecture.md §2), read from the source: the service
(`gateway/`) imports neither the command line (`rollout_cli/`), the example agents, the reference trainer nor the
engine simulator; engine adapters import nothing of the gateway; the shared utilities (`common/`) import none of the
project's other packages."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests import REPO

ROOT = REPO


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, at any depth (function-level imports included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def offenders(folder: str, forbidden: tuple[str, ...], exempt: tuple[str, ...] = ()) -> list[str]:
    bad = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if relative.startswith(exempt):
            continue
        for module in sorted(imported_modules(path)):
            if any(module == f or module.startswith(f + ".") for f in forbidden):
                bad.append(f"{relative} imports {module}")
    return bad


@pytest.mark.parametrize(
    ("folder", "forbidden", "exempt"),
    [
        ("gateway", ("rollout_cli", "rollout_agents", "trainers", "backends.sim", "backends.launcher"), ()),
        ("backends", ("gateway", "rollout_agents", "trainers"), ()),
        ("common", ("gateway", "backends", "rollout_agents", "trainers"), ()),
    ],
)
def test_a_layer_imports_nothing_above_it(folder: str, forbidden: tuple[str, ...], exempt: tuple[str, ...]) -> None:
    assert offenders(folder, forbidden, exempt) == []


def test_only_the_wiring_imports_the_fast_path() -> None:
    """The fast path (`gateway/fastpath/`) is chosen where the gateway is assembled, from `settings.fastpath`; no
    domain module depends on it, so turning it off leaves nothing half on."""
    wiring = ("gateway/fastpath/", "gateway/app.py", "gateway/services.py", "gateway/server.py")
    assert offenders("gateway", ("gateway.fastpath",), wiring) == []
    assert offenders("backends", ("gateway.fastpath",)) == []


def test_the_rule_sees_an_import_inside_a_function(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from backends.sim.server import SimReplica\n    import rollout_agents.runner\n")
    assert imported_modules(module) == {"backends.sim.server", "rollout_agents.runner"}
