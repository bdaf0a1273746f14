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
