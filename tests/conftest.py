"""Shared fixtures: single-threaded torch and a tiny word-level SentencePiece tokenizer."""

import pytest
import sentencepiece as spm
import torch
from tiny import word_tokenizer


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    # Tiny tensors gain nothing from intra-op threads, and on a shared 2-core machine idle OpenMP threads
    # spin-waiting for busy cores make every op many times slower.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def sp() -> spm.SentencePieceProcessor:
    return word_tokenizer()
