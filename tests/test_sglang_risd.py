"""RISD served by stock SGLang: a randomly initialised LoRA adapter gated to the [MASK] positions
changes the proposals but never the verify positions, so greedy output is the base model's."""

from __future__ import annotations

import pytest
from sglang_fixtures import (
    ar_reference,  # noqa: F401  (fixture)
    check_lossless,
    heldout_ids,  # noqa: F401  (fixture)
    make_random_lora,
    native_generate,
    server_args,
    start_server,
    wait_tokens_zero,
)

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def adapter(tmp_path_factory, tiny_base_path):
    return make_random_lora(tiny_base_path, tmp_path_factory.mktemp("risd") / "adapter", rank=8, seed=0)


@pytest.fixture(scope="module")
def server(tmp_path_factory, ar_reference, adapter):
    proc = start_server(tmp_path_factory, "risd", server_args(
        "--disable-radix-cache", "--speculative-algorithm", "RISD", "--selfspec-stride", "3",
        "--selfspec-lora", str(adapter)))
    yield proc
    proc.stop()


def test_risd_adapter_is_attached(server):
    log = server.log_file.read_text()
    assert "gated LoRA" in log and "layers" in log


def test_risd_greedy_equals_base_ar_sequential(server, heldout_ids, ar_reference):
    res = check_lossless(server.base_url, heldout_ids, ar_reference, concurrent=False)
    assert all(m["selfspec_mode"] == "RISD" for m in res["metas"])


def test_risd_greedy_equals_base_ar_burst_and_kv_released(server, heldout_ids, ar_reference):
    check_lossless(server.base_url, heldout_ids, ar_reference, concurrent=True)
    assert wait_tokens_zero(server.base_url) == 0


def test_risd_sampling_reproducible(server, heldout_ids):
    kw = dict(max_new_tokens=16, temperature=0.7, sampling_seed=3)
    a = native_generate(server.base_url, heldout_ids[0], **kw)
    b = native_generate(server.base_url, heldout_ids[0], **kw)
    assert a["output_ids"] == b["output_ids"]
