"""Shared fixtures: the bundled model's path and a small-engine factory."""

from __future__ import annotations

import pytest

from mooncaked.config import load_settings


@pytest.fixture(scope="session")
def bundled_model():
    """Path of the bundled SmolLM2-135M-Instruct GGUF file."""
    from mooncaked.model.weights import bundled_model_path

    return bundled_model_path()


def make_settings(**overrides):
    """Settings with dotted overrides, e.g. make_settings(**{"engine.block_size": 16})."""
    return load_settings(None, overrides)
