"""The store in pytest-asyncio fixtures, whose set-up and tear-down run in different tasks (no anyio
plugin here: pytest-asyncio drives these tests, as it does a user's)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from aiotensor import TensorStore

from .conftest import small_state


@pytest_asyncio.fixture
async def opened_store(tmp_path: Any) -> AsyncIterator[TensorStore]:
    async with TensorStore(tmp_path) as store:
        yield store


@pytest.mark.asyncio
async def test_a_pytest_asyncio_fixture_opens_and_closes_the_store(opened_store: TensorStore) -> None:
    h = opened_store.save(1, small_state(1))  # left in flight: the fixture's tear-down waits for it
    await h.staged
    assert opened_store.steps() in ([], [1])


@pytest.mark.asyncio
async def test_a_store_opened_by_a_fixture_loads(opened_store: TensorStore) -> None:
    await opened_store.save(1, small_state(1))
    assert (await opened_store.load())["step"] == 1
