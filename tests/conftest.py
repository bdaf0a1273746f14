"""Shared fixtures: the embedded model, held-out prompts, real SGLang servers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HELDOUT_PROMPTS = REPO / "bench" / "prompts" / "heldout.jsonl"


@pytest.fixture(scope="session")
def heldout_prompts() -> list[str]:
    return [json.loads(line)["prompt"] for line in HELDOUT_PROMPTS.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="session")
def tiny_base_path() -> Path:
    from selfspec.models import resolve_model

    return resolve_model("tiny-base")


@pytest.fixture(scope="module")
def one_torch_thread():
    """Run a module's tiny-model forwards on one torch thread: on 2 shared cores, small forwards
    with 2 OpenMP threads spend their time synchronising (and starve a neighbour)."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
