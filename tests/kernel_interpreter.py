"""Shared set-up of the kernel test modules: run Triton kernels in the interpreter on CPU.

Imported by tests/test_kernels_*.py (this file's name keeps it out of that glob, which
test_kernels_subprocess.py uses).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

import pytest
import torch


def skip_unless_kernels_run_here() -> None:
    """Skip the calling test module (at import) when its kernels cannot run in this process."""
    if importlib.util.find_spec("triton") is None:  # not imported here: see _kernels_run_in_this_process
        pytest.skip("triton is not installed", allow_module_level=True)
    if not _kernels_run_in_this_process():
        pytest.skip("triton was imported without TRITON_INTERPRET=1; test_kernels_subprocess.py runs these tests",
                    allow_module_level=True)


def _kernels_run_in_this_process() -> bool:
    """On CUDA the kernels compile. Without CUDA they run in the Triton interpreter, which Triton
    fixes when a kernel -- including triton.language's own helpers -- is decorated, i.e. at import:
    TRITON_INTERPRET=1 is set only while triton and selfspec's kernel modules are first imported
    (so later imports and subprocesses keep their environment). If this process imported triton
    before, without the interpreter (`make test`: SGLang is imported by earlier test modules), these
    tests are skipped here and test_kernels_subprocess.py runs them in a fresh process."""
    if torch.cuda.is_available():
        return True
    modules = ("triton.language", "selfspec.kernels.gated_lora_triton", "selfspec.kernels.verify_triton")
    if any(name not in sys.modules for name in modules):
        previous = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1"
        try:
            for name in modules:
                importlib.import_module(name)
        finally:
            if previous is None:
                os.environ.pop("TRITON_INTERPRET", None)
            else:
                os.environ["TRITON_INTERPRET"] = previous
    import triton.language as tl

    import selfspec.kernels.gated_lora_triton as glt_
    import selfspec.kernels.verify_triton as vt_

    return type(tl.max).__name__ == "InterpretedFunction" and vt_.INTERPRETED and glt_.INTERPRETED


@pytest.fixture(autouse=True, scope="module")
def _interpreter_env():
    """Triton also consults TRITON_INTERPRET while interpreted kernels run (lazy imports,
    constexpr helpers): set it for this module's tests only."""
    if torch.cuda.is_available():
        yield
        return
    patch = pytest.MonkeyPatch()
    patch.setenv("TRITON_INTERPRET", "1")
    yield
    patch.undo()
