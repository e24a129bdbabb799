"""mtrain's fixtures: the preprocessed test corpus, and one thread per test."""

from __future__ import annotations

import pytest
import torch

from tests.support.corpus import build_corpus


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run fastest on one thread, and far faster than on two when other jobs share the 2 cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> str:
    return build_corpus(tmp_path_factory.mktemp("corpus"))
