"""Shared fixtures: the bundled model's path and a small-engine factory."""

from __future__ import annotations

import os

import pytest

# Triton kernels run on the CPU interpreter in tests. Set before anything imports triton,
# so every kernel test runs in this process (the GPU check runs with --noconftest).
os.environ.setdefault("TRITON_INTERPRET", "1")



@pytest.fixture(scope="session")
def bundled_model():
    """Path of the bundled SmolLM2-135M-Instruct GGUF file."""
    from mooncaked.model.weights import bundled_model_path

    return bundled_model_path()


