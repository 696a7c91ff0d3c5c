"""Shared fixtures: the bundled model's path and a small-engine factory."""

from __future__ import annotations

import pytest



@pytest.fixture(scope="session")
def bundled_model():
    """Path of the bundled SmolLM2-135M-Instruct GGUF file."""
    from mooncaked.model.weights import bundled_model_path

    return bundled_model_path()


