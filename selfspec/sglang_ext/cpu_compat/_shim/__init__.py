"""Path root for the `sgl_kernel` stand-in (see `selfspec.sglang_ext.cpu_compat`).

This directory is put on `sys.path` so that `import sgl_kernel` finds `sgl_kernel/` here, in the
launching process and in SGLang's spawned subprocesses. It must hold no other top-level module.
(This `__init__.py` only exists so that packaging includes the directory.)
"""
