"""The suite never writes into the user's store cache, module-scoped fixtures included."""

import os
from pathlib import Path

import pytest

from mira.store.cache import cache_dir


@pytest.fixture(scope="module")
def cache_seen_by_a_module_fixture():
    return cache_dir()  # what a module fixture converting on first use would write into


def test_a_module_fixture_converts_into_the_sessions_folder(cache_seen_by_a_module_fixture, tmp_path_factory):
    basetemp = tmp_path_factory.getbasetemp().resolve()
    assert Path(os.environ["MIRA_CACHE"]).resolve().is_relative_to(basetemp)
    assert cache_seen_by_a_module_fixture.resolve().is_relative_to(basetemp)
