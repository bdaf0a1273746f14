"""Export round trip through stock SGLang with the selfspec plugin: a full I-DLM export is served
with --speculative-algorithm ISD (stride and mask token from its selfspec.json), a gated-LoRA
export with RISD over its base; greedy output equals the HF engine's greedy AR output."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from sglang_fixtures import native_generate, server_args, start_server

pytestmark = pytest.mark.server

PROMPTS = ["def f(x):\n", "class Stack:\n    def push(self, item):\n", "import os\n\n", "    return ["]
MAX_NEW = 24


@pytest.fixture(scope="module")
def exports(micro_config, tmp_path_factory):
    from selfspec.training.idlm import train_idlm

    root = tmp_path_factory.mktemp("exports")
    full = micro_config(root / "isd", steps=6, curriculum=[3])
    lora = micro_config(root / "risd", steps=6, curriculum=[3], lora_rank=4, lr=1e-2)
    train_idlm(full)
    train_idlm(lora)
    return {"isd": Path(full.out), "risd": Path(lora.out)}


def _hf_greedy(model_dir: Path, prompts_ids: list[list[int]]) -> list[list[int]]:
    from selfspec.decoding.sampling import SamplingParams
    from selfspec.engines.hf import HFEngine

    engine = HFEngine.from_pretrained(model_dir, dtype=torch.float32)
    return [o.token_ids for o in engine.generate(prompts_ids, max_new_tokens=MAX_NEW, sampling=SamplingParams(),
                                                 mode="ar", stop_token_ids=[])]


def _ids(model_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]


def _serve_and_compare(tmp_path_factory, name, model, extra, reference, prompts_ids, mode):
    proc = start_server(tmp_path_factory, name, server_args("--disable-radix-cache", *extra), model=model)
    try:
        for ids, ref in zip(prompts_ids, reference):
            out = native_generate(proc.base_url, ids, MAX_NEW, ignore_eos=True)
            assert out["output_ids"] == ref
            mode_seen = out.get("meta_info", {}).get("selfspec_mode")
            assert mode_seen in (None, mode)
    finally:
        proc.stop()


def test_isd_export_serves_in_sglang(exports, tmp_path_factory):
    ids = _ids(exports["isd"])
    ref = _hf_greedy(exports["isd"], ids)
    _serve_and_compare(tmp_path_factory, "isd-export", exports["isd"], ["--speculative-algorithm", "ISD"], ref, ids,
                       "ISD")


def test_risd_adapter_export_serves_in_sglang(exports, micro_dir, tmp_path_factory):
    ids = _ids(micro_dir)
    ref = _hf_greedy(micro_dir, ids)  # RISD is lossless: the base's greedy AR output
    extra = ["--speculative-algorithm", "RISD", "--selfspec-lora", str(exports["risd"]), "--selfspec-stride", "3"]
    _serve_and_compare(tmp_path_factory, "risd-export", micro_dir, extra, ref, ids, "RISD")
