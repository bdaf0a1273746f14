"""Export round trip through stock SGLang with the selfspec plugin: a full I-DLM export is served
with --speculative-algorithm ISD (stride and mask token from its selfspec.json), a gated-LoRA
export with RISD over its base; greedy output equals the HF engine's greedy AR output."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from sglang_fixtures import check_own_steps, internal_state, native_generate, server_args, start_server

pytestmark = pytest.mark.server

PROMPTS = ["def f(x):\n", "class Stack:\n    def push(self, item):\n", "import os\n\n", "    return ["]
MAX_NEW = 24


@pytest.fixture(scope="module")
def exports(micro_config, tmp_path_factory):
    from selfspec.training.idlm.objective import train_idlm

    root = tmp_path_factory.mktemp("exports")
    full = micro_config(root / "isd", steps=6, curriculum=[3])
    lora = micro_config(root / "risd", steps=6, curriculum=[3], lora_rank=4, lr=1e-2)
    train_idlm(full)
    train_idlm(lora)
    return {"isd": Path(full.out), "risd": Path(lora.out)}


def _hf_greedy(model_dir: Path, prompts_ids: list[list[int]]) -> list[list[int]]:
    from selfspec.decoding.requests.sampling import SamplingParams
    from selfspec.engines.hf import HFEngine

    engine = HFEngine.from_pretrained(model_dir, dtype=torch.float32)
    return [o.token_ids for o in engine.generate(prompts_ids, max_new_tokens=MAX_NEW, sampling=SamplingParams(),
                                                 mode="ar", stop_token_ids=[])]


def _ids(model_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]


def _serve_and_compare(tmp_path_factory, name, model, extra, reference, prompts_ids, mode) -> dict:
    """Serve `model` in `mode` and send the prompts one at a time: each answer is the reference
    and says it was served by `mode`; /server_info says the mode's own steps ran and committed
    tokens (a server that silently decoded plain AR would pass the output check alone). Returns
    the server's selfspec state."""
    proc = start_server(tmp_path_factory, name, server_args("--disable-radix-cache", *extra), model=model)
    try:
        for ids, ref in zip(prompts_ids, reference):
            out = native_generate(proc.base_url, ids, MAX_NEW, ignore_eos=True)
            assert out["output_ids"] == ref
            assert out["meta_info"]["selfspec_mode"] == mode
        check_own_steps(proc.base_url, mode)
        return internal_state(proc.base_url)["selfspec"]
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
    state = _serve_and_compare(tmp_path_factory, "risd-export", micro_dir, extra, ref, ids, "RISD")
    assert state["adapter"] is not None and state["adapter"]["layers"] > 0, state["adapter"]  # the export's LoRA


def test_embedded_jacobi_forcing_model_serves_jacobi_with_no_flags(tmp_path_factory, heldout_prompts):
    """tiny-jf named as the model, `--speculative-algorithm JACOBI` and nothing else: the block size
    and multi-block settings come from its selfspec.json, the output is its own greedy AR output
    (the HF engine's) token for token, sequentially and in a concurrent burst, on the default
    server path (radix cache, chunked prefill), and its own steps commit several tokens per forward."""
    from sglang_fixtures import DEFAULT_PATH, burst

    from selfspec.models import resolve_model

    model = resolve_model("tiny-jf")
    ids = _ids(model)[:2] + [ids for ids in (_ids_of(model, p) for p in heldout_prompts[:6])]
    ref = _hf_greedy(model, ids)
    proc = start_server(tmp_path_factory, "tiny-jf", server_args(*DEFAULT_PATH, "--speculative-algorithm", "JACOBI"),
                        model=model)
    try:
        seq = [native_generate(proc.base_url, x, MAX_NEW, ignore_eos=True) for x in ids]
        par = burst(lambda x: native_generate(proc.base_url, x, MAX_NEW, ignore_eos=True), ids, 8)
        for out in seq + par:
            assert out["meta_info"]["selfspec_mode"] == "JACOBI"
        assert [o["output_ids"] for o in seq] == ref
        assert [o["output_ids"] for o in par] == ref
        check_own_steps(proc.base_url, "JACOBI")
        # JACOBI's own steps commit several tokens per forward: read per kind of step, as the
        # run-time check may serve a batch of one with the lookup or AR arm by this machine's clock
        own = internal_state(proc.base_url)["selfspec"]["steps_by_kind"]["own"]
        assert own["tokens"] / own["request_steps"] > 1.3, own
    finally:
        proc.stop()


def _ids_of(model_dir: Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)(text, add_special_tokens=False)["input_ids"]
