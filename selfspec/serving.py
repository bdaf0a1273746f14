"""Launching stock SGLang with the selfspec plugin: command line, environment, lifecycle."""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from selfspec.errors import UserError
from selfspec.models import EMBEDDED_MODELS, resolve_with_adapter

SMALL_CPU_CORES = 4


@contextmanager
def server_threads(threads: int | None) -> Iterator[None]:
    """OMP_NUM_THREADS for the servers started inside (their torch threads), restored after;
    None or 0 leaves it as it is."""
    old = os.environ.get("OMP_NUM_THREADS")
    if threads:
        os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = old


class ServeError(UserError):
    """A problem the user can fix, reported as one line instead of a traceback."""


def cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # a broken torch install is reported by SGLang itself
        return False


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _has_flag(args: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def split_passthrough(argv: list[str]) -> tuple[list[str], list[str]]:
    """`selfspec serve ... -- SGLANG ARGS`: (our arguments, the ones passed through to SGLang)."""
    if "--" not in argv:
        return list(argv), []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1:]


def _flag_value(args: list[str], flag: str) -> str | None:
    for i, a in enumerate(args):
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
        if a == flag and i + 1 < len(args):
            return args[i + 1]
    return None


def _adapter_args(adapter: Path, base: Path, extra: list[str]) -> list[str]:
    """An adapter-only checkpoint (a RISD gated LoRA) is served as its base plus the adapter:
    SGLang loads the base, the plugin attaches the adapter at MASK positions."""
    algorithm = _flag_value(extra, "--speculative-algorithm")
    if algorithm is None:
        extra = extra + ["--speculative-algorithm", "RISD"]
    elif algorithm.upper() != "RISD":
        raise ServeError(f"{adapter} is a RISD adapter (gated LoRA over {base}); serve it with "
                         f"--speculative-algorithm RISD, or serve the base itself for {algorithm}")
    if not _has_flag(extra, "--selfspec-lora"):
        extra = extra + ["--selfspec-lora", str(adapter)]
    return extra


@dataclass
class ServerSpec:
    model: str
    host: str = "127.0.0.1"
    port: int | None = 30000  # None: a free port, chosen at start (and again if another process takes it)
    extra_args: list[str] = field(default_factory=list)
    cpu: bool | None = None  # None: decide from torch.cuda.is_available()

    def command(self) -> tuple[list[str], dict[str, str]]:
        if importlib.util.find_spec("sglang") is None:
            raise ServeError(
                "SGLang is not installed in this Python environment. Run `make setup` "
                "(CPU development venv) or `pip install '/path/to/selfspec[gpu]'` (GPU), then retry."
            )
        from selfspec.checkpoints.files import is_repo_id

        hub_name = is_repo_id(self.model) and self.model not in EMBEDDED_MODELS
        # a Hub name goes to SGLang as it is: it resolves it through the Hub cache, as the plugin does
        model_path, adapter = (self.model, None) if hub_name else resolve_with_adapter(self.model)
        extra = list(self.extra_args)
        if adapter is not None:
            extra = _adapter_args(adapter, model_path, extra)
        if self.port is None:
            self.port = free_port(self.host)
        elif port_in_use(self.host, self.port):
            raise ServeError(f"port {self.port} on {self.host} is already in use; pick another with --port")
        args = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_path),
                "--host", self.host, "--port", str(self.port)]
        env = dict(os.environ)
        if not hub_name:  # a local checkpoint: nothing to fetch (a Hub name may need the Hub)
            env.setdefault("HF_HUB_OFFLINE", "1")
            env.setdefault("TRANSFORMERS_OFFLINE", "1")
        from selfspec.sglang_ext.cpu_defaults import CPU_ENGINE_ENV, accelerator_present, cli_defaults

        # the plugin's rule for a bare launch, so both choose the CPU on the same machines
        use_cpu = (not accelerator_present()) if self.cpu is None else self.cpu
        if use_cpu:
            env[CPU_ENGINE_ENV] = "1"
            if (os.cpu_count() or 1) <= SMALL_CPU_CORES:
                # On a small machine two OpenMP threads spend small forwards waiting for each
                # other: tiny-base served 15% faster with one (idle 2-core box, `make demo`) and
                # ~20x faster under contention. Larger machines keep OpenMP's default.
                env.setdefault("OMP_NUM_THREADS", "1")
            for flag, value in cli_defaults().items():
                if not _has_flag(extra, flag):
                    args += [flag, *value]
        return args + extra, env


_PORT_CLASH = "address already in use"
_PORT_ATTEMPTS = 3


class ServerProcess:
    """Start a server in its own process group, wait until it answers, stop it (and its children).

    With `ServerSpec(port=None)` the port is chosen free at start; a free port can still be taken
    by another process before SGLang binds it (parallel test servers, benchmarks), so a start
    that fails with "address already in use" in its log is retried on a fresh port."""

    def __init__(self, spec: ServerSpec, log_path: Path | None = None, startup_timeout: float = 300.0):
        self.spec = spec
        self.log_path = log_path
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None
        self._log = None

    @property
    def base_url(self) -> str:
        return f"http://{self.spec.host}:{self.spec.port}"

    def start(self) -> "ServerProcess":
        auto_port = self.spec.port is None
        attempt = 1
        while True:
            argv, env = self.spec.command()
            self._log = open(self.log_path, "w") if self.log_path else subprocess.DEVNULL
            self.proc = subprocess.Popen(argv, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
            try:
                self.wait_ready()
                return self
            except ServeError:
                self.stop()
                if not (auto_port and attempt < _PORT_ATTEMPTS and self._port_clash()):
                    raise
            attempt += 1
            self.spec.port = None  # choose again

    def _port_clash(self) -> bool:
        """Whether the failed start's log says a port it bound was taken."""
        if self.log_path is None:
            return False
        try:
            return _PORT_CLASH in Path(self.log_path).read_text(errors="replace").lower()
        except OSError:
            return False

    def wait_ready(self) -> None:
        deadline = time.time() + self.startup_timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise ServeError(f"the SGLang server exited with code {self.proc.returncode} during startup"
                                 + (f"; see {self.log_path}" if self.log_path else ""))
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(1.0)
        self.stop()
        raise ServeError(f"the SGLang server did not become healthy within {self.startup_timeout:.0f} s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
            except ProcessLookupError:
                pass
        if self._log not in (None, subprocess.DEVNULL):
            self._log.close()
            self._log = None

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
