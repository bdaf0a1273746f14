"""The `external` prompt set and the long prompts: code the embedded models never saw, from a
permissively licensed package, overlapping no other set; windows of exactly N tokens from the
files `eval` is cut from. No model loads and no server starts (the tokenizer only): seconds."""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import re
import sys
from collections import Counter
from pathlib import Path

import pytest

from selfspec import prompts as P
from selfspec.corpus import iter_stdlib_files, load_stdlib_split
from selfspec.errors import UsageError


@pytest.fixture(scope="module")
def external() -> list[str]:
    return P.load_prompt_set("external")


@pytest.fixture(scope="module")
def provenance() -> dict:
    return P.external_provenance()


def test_external_is_a_named_set_of_160_distinct_prompts(external):
    assert "external" in P.SET_NAMES and P.describe("external") == "external"
    assert P.set_path("external").is_file() and P.EXTERNAL_PROVENANCE.is_file()
    assert len(external) == P.SPLIT_COUNT and len(set(external)) == len(external)
    assert all(len(p) >= 40 and p.endswith("\n") for p in external)
    texts, _ = P.load_prompts("external", tokenizer=lambda t, add_special_tokens: {"input_ids": list(t.encode())},
                              limit=4)
    assert texts == external[:4]


def test_external_overlaps_no_other_set(external):
    others = {name: set(P.load_prompt_set(name)) for name in ("tune", "eval", "humaneval")}
    others["heldout"] = set(P.load_prompt_set(str(P.HELDOUT_PROMPTS)))
    for name, texts in others.items():
        assert not set(external) & texts, name
        assert not [p for p in external if any(p in t or t in p for t in texts)], name


def test_external_is_not_the_standard_library_nor_pips_vendored_code(external):
    """No prompt occurs in any source file of the embedded models' corpus (train and held-out),
    nor in pip's vendored packages."""
    stdlib = "\0".join(f.text for f in iter_stdlib_files())
    assert not [p for p in external if p in stdlib]
    pip = importlib.util.find_spec("pip")
    if pip is None:
        pytest.fail("pip is part of every venv `make setup` builds")
    vendored = "\0".join(f.read_text(errors="replace") for f in sorted((Path(pip.origin).parent / "_vendor").rglob("*.py")))
    assert vendored and not [p for p in external if p in vendored]


def test_the_provenance_names_a_permissive_package_and_the_file(external, provenance):
    package = provenance["package"]
    assert package.split(".")[0] not in sys.stdlib_module_names and package.split(".")[0] != "pip"
    assert re.search(r"\b(BSD|MIT|Apache)\b", provenance["license"]), provenance["license"]
    assert provenance["version"] and provenance["distribution"]
    body = P.set_path("external").read_bytes()
    assert provenance["sha256"] == hashlib.sha256(body).hexdigest(), "external.jsonl changed without its provenance"
    assert provenance["count"] == len(provenance["prompts"]) == len(external)
    files = [w["file"] for w in provenance["prompts"]]
    assert sorted(set(files)) == provenance["files"]
    assert max(Counter(files).values()) <= 3  # each file once, or a few times
    for path in files:
        parts = Path(path).parts
        assert parts[0] == package.split(".")[0] and "_vendor" not in parts
        assert not {"test", "tests"} & set(parts) and not parts[-1].startswith("test_")


def test_the_committed_set_is_the_rule_output(external, provenance):
    """Rewritten from the installed package (pinned to the recorded version by requirements/data.txt)."""
    try:
        version = importlib.metadata.version(provenance["distribution"])
    except importlib.metadata.PackageNotFoundError:
        version = None
    assert version == provenance["version"], (
        f"{provenance['distribution']} {version} installed, the set was cut from {provenance['version']}: "
        "`make setup` installs the pinned version (requirements/data.txt)")
    prompts, again = P.external_prompts(provenance["package"])
    assert prompts == external
    assert {k: v for k, v in again.items() if k != "python"} == {k: v for k, v in provenance.items() if k != "python"}
    root = Path(importlib.util.find_spec(provenance["package"]).origin).parent
    for text, where in zip(external[:20], provenance["prompts"]):
        lines = (root.parent / where["file"]).read_text().splitlines(keepends=True)
        assert "".join(lines[where["line"] - 1:]).startswith(text)


@pytest.mark.parametrize("package", ["json", "pip", "pip._vendor.rich", "no_such_package_here"])
def test_the_external_set_refuses_the_stdlib_pip_and_missing_packages(package):
    with pytest.raises(UsageError, match=f"--external {re.escape(package)}"):
        P.external_prompts(package)


def test_package_license_reads_the_spdx_expression_first():
    class Meta(dict):
        def get_all(self, key):
            return self.get(key + "s")

    class Dist:
        def __init__(self, meta):
            self.metadata = Meta(meta)

    assert P.package_license(Dist({"License-Expression": "MIT", "License": "x"})) == "MIT"
    assert P.package_license(Dist({"License": "BSD"})) == "BSD"
    long_text = "Copyright (c) 2001 " + "x" * 200
    assert P.package_license(Dist({"License": long_text, "Classifiers": [
        "License :: OSI Approved :: BSD License", "Programming Language :: Python"]})) == "BSD License"
    assert P.package_license(Dist({})) == "unknown"


# ------------------------------------------------------------------ long prompts
@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from selfspec.models import resolve_model

    return AutoTokenizer.from_pretrained(str(resolve_model("tiny-idlm")))


def test_long_prompts_hold_exactly_n_tokens_of_the_eval_files(tokenizer):
    eval_files = [f.text for f in load_stdlib_split().heldout if P.split_of(f.relpath) == "eval"]
    for n, count in ((256, 12), (2048, 6)):
        texts = P.long_prompts(tokenizer, n, count)
        assert len(texts) == count and len(set(texts)) == count
        assert [len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts] == [n] * count
        assert all(any(t in f for f in eval_files) for t in texts)
    assert P.long_prompts(tokenizer, 256, 12) == P.long_prompts(tokenizer, 256, 12)  # deterministic
    assert P.long_prompts(tokenizer, 10**6, 4) == []  # no file is that long
