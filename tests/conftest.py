"""Test-wide settings: one torch thread (tests may run beside others on a small machine),
and cost profiles cached in the session's temporary folder, not the user's cache (the tiny
models of each session would leave a profile there every run)."""

from __future__ import annotations

import os

import pytest
import torch

from faser.runner.profiler import PROFILE_CACHE_ENV

torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def profile_cache(tmp_path_factory):
    """Set before any engine starts (Ray's workers inherit it from the driver's environment)."""
    previous = os.environ.get(PROFILE_CACHE_ENV)
    os.environ[PROFILE_CACHE_ENV] = str(tmp_path_factory.mktemp("profiles"))
    yield
    if previous is None:
        os.environ.pop(PROFILE_CACHE_ENV, None)
    else:
        os.environ[PROFILE_CACHE_ENV] = previous
