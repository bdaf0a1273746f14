"""Runs the kernel tests in a fresh process when this one cannot run them.

Without CUDA the Triton kernels run in Triton's interpreter, which Triton fixes when triton is
first imported. Under `make test` earlier test modules import SGLang (and so triton) without
TRITON_INTERPRET=1; the test_kernels_* modules then skip themselves and this test runs them in a
new interpreter process with TRITON_INTERPRET=1, failing if any of them fails. When the kernel
modules could run in this process (CUDA, or triton first imported by them) it skips.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

import pytest

TESTS = Path(__file__).resolve().parent
KERNEL_TESTS = sorted(p for p in TESTS.glob("test_kernels_*.py") if p.name != Path(__file__).name)


def _in_process_ok() -> bool:
    if torch.cuda.is_available():
        return True
    if "triton" not in sys.modules:
        return True  # the kernel test modules will import it themselves, under the interpreter
    import triton.language as tl

    vt = sys.modules.get("selfspec.kernels.verify_triton")
    return type(tl.max).__name__ == "InterpretedFunction" and (vt is None or vt.INTERPRETED)


@pytest.mark.skipif(_in_process_ok(), reason="the kernel tests run in this process")
@pytest.mark.timeout(1800)
def test_kernel_tests_in_an_interpreter_process():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *map(str, KERNEL_TESTS)]
    proc = subprocess.run(cmd, cwd=TESTS.parent, env=env, capture_output=True, text=True, timeout=1700)
    print(proc.stdout[-4000:])
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-4000:]
