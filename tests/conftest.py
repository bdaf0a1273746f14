"""Shared fixtures: the embedded model, held-out prompts, real SGLang servers."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

# The SGLang tests' session fixtures are registered here, once: imported into each test module,
# each module would hold its own copy (pytest keys a fixture by the module defining it) and the
# AR reference server would be started and queried again for every module.
from sglang_fixtures import ar_reference, heldout_ids, tokenizer  # noqa: F401,E402  (fixtures)

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------ two workers (make test)
#: Tests that run alone, in one serial group on one pytest-xdist worker, in collection order:
#: everything that starts SGLang servers or several training processes (the machine's rule: one
#: server / training at a time). The other worker takes the remaining modules, each module as one
#: unit so that its module-scoped fixtures (models, engines, trained micro models) are built once.
SERIAL_MARKERS = ("server", "multiprocess")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook turns the groups into node ids
def pytest_collection_modifyitems(config, items):
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    serial = {id(it) for it in items if any(it.get_closest_marker(m) for m in SERIAL_MARKERS)
              or "ar_reference" in getattr(it, "fixturenames", ())}
    for it in items:
        it.add_marker(pytest.mark.xdist_group("serial" if id(it) in serial else it.nodeid.split("::")[0]))
    # the serial group is the longest unit: first in line, so the other worker never waits for it
    items.sort(key=lambda it: id(it) not in serial)  # stable: collection order within each part


def pytest_xdist_node_collection_finished(node, ids):
    """On the controller: every worker's node ids must carry their group, or nothing is grouped."""
    if ids and node.config.getvalue("dist") == "loadgroup" and "@" not in ids[0]:
        pytest.exit("pytest-xdist's --dist loadgroup did not group the tests (this pytest version ignores "
                    "its node id suffix: pytest-dev/pytest-xdist#1386), so servers would start side by "
                    "side. Run `make setup` (it pins pytest, requirements/test.txt) or "
                    "`make test TEST_WORKERS=0`.", returncode=4)


def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # one core per worker: two workers with two OpenMP threads each would spend their
        # time waiting for each other at every op on this 2-core machine
        import torch

        torch.set_num_threads(1)
        os.environ.setdefault("OMP_NUM_THREADS", "1")


from selfspec.prompts import HELDOUT_PROMPTS  # noqa: E402


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


# ------------------------------------------------------------------------------ training: a micro model
MICRO_STEPS = 20


def _stdlib_texts(names: list[str]) -> list[str]:
    from selfspec.corpus import stdlib_root

    return [(stdlib_root() / n).read_text() for n in names]


@pytest.fixture(scope="module")
def micro_dir(tmp_path_factory) -> Path:
    """A micro Qwen3 (2 layers, width 64) with a 512-token BPE that has [MASK] and ChatML."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from selfspec.training.tokenizer import train_bpe_tokenizer

    import torch

    out = tmp_path_factory.mktemp("micro")
    tok = train_bpe_tokenizer(_stdlib_texts(["textwrap.py", "shlex.py", "bisect.py"]), 512, out)
    torch.manual_seed(0)
    eos = tok.eos_token_id
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      tie_word_embeddings=True, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    Qwen3ForCausalLM(cfg).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data") / "text.jsonl"
    texts = _stdlib_texts(["textwrap.py", "shlex.py", "bisect.py", "fnmatch.py", "colorsys.py", "keyword.py"])
    lines = []
    for t in texts:  # many records, so both splits get some
        chunks = [t[i : i + 1500] for i in range(0, len(t), 1500)]
        lines += [json.dumps({"text": c}) for c in chunks]
    out.write_text("\n".join(lines) + "\n")
    return out


@pytest.fixture(scope="module")
def micro_config(micro_dir, data_file):
    """`micro_config(out, **overrides)`: a fast IDLMConfig on the micro model and data."""
    return lambda out, **kw: _micro_config(micro_dir, data_file, out, **kw)


def _micro_config(micro_dir, data_file, out, **kw):
    from selfspec.training.idlm.objective import IDLMConfig

    base = dict(base=str(micro_dir), out=str(out), stride=3, curriculum=[2, 3], data=[str(data_file)],
                seq_len=48, batch_size=4, steps=MICRO_STEPS, lr=3e-3, warmup_ratio=0.1, eval_every=0,
                eval_tokens=768, threads=2, progress_bar=False, checkpoint_dir=str(Path(out) / "ckpt"))
    base.update(kw)
    return IDLMConfig(**base)


@pytest.fixture
def buckets_used(monkeypatch):
    """(batch size, bucket mode object) of every step a width plan's mode runs."""
    import selfspec.decoding.widths.planned_mode as planned_mode

    seen: list = []
    original = planned_mode.PlannedMode.layouts

    def spy(self, seqs):
        out = original(self, seqs)
        seen.append((len(seqs), self.current))
        return out

    monkeypatch.setattr(planned_mode.PlannedMode, "layouts", spy)
    return seen
