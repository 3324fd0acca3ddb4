"""Fixtures shared by the test files."""

from __future__ import annotations

import os

import pytest

from .helpers import environ_without_gradnan


@pytest.fixture
def no_gradnan_variables(monkeypatch):
    """No ``GRADNAN_*`` variable of the caller's shell reaches ``install()``: only what a test passes."""
    for key in [key for key in os.environ if key.startswith("GRADNAN_")]:
        monkeypatch.delenv(key)


@pytest.fixture
def clean_environ():
    """``os.environ`` less the ``GRADNAN_*`` variables, for a child process."""
    return environ_without_gradnan()
