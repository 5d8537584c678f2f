"""The HTTP transport's tests run each test on asyncio's event loop and on uvloop's: the gateway serves on uvloop,
and the two loops' transports are different classes that behave alike only by contract."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

import pytest
import uvloop


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    """Every test under this folder, once per loop (pytest-asyncio parametrizes it by these names)."""
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
