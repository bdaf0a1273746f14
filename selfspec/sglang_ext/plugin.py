"""SGLang plugin entry point (`sglang.srt.plugins` group): runs in every SGLang process."""

from __future__ import annotations


def register() -> None:
    from selfspec.sglang_ext.cpu_compat import install_cpu_compat

    install_cpu_compat()
