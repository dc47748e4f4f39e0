"""Fixtures of the training-script tests."""

from __future__ import annotations

import pytest

from tests.train import make_tiny_llama, make_tiny_tokenizer


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return make_tiny_tokenizer()


@pytest.fixture()
def tiny_llama():
    return make_tiny_llama()


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models run faster on one thread than on two cores shared with other jobs; restored afterwards."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
