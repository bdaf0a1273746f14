"""selfspec installed from its wheel: the package carries its data (embedded models, prompt files)
and reads nothing from a source tree. The cheap part of `make wheel-check` (scripts/wheel_check.sh,
which also benchmarks and serves from the installed package)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{cmd} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _copy_checkout(dest: Path) -> None:
    """This checkout's tracked and new files (what a wheel is built from), so that the build writes
    nothing into the repository."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")
    archive = dest.parent / "src.tar"
    with tarfile.open(archive, "w") as tar:
        for name in filter(None, listed):
            if (REPO / name).exists():
                tar.add(REPO / name, arcname=name, recursive=False)
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="tar")
    archive.unlink()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    if importlib.util.find_spec("setuptools") is None:
        pytest.fail("building the wheel needs setuptools: run `make setup`")
    root = tmp_path_factory.mktemp("wheel")
    _copy_checkout(root / "src")
    proc = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(root / "dist"),
                 str(root / "src")], cwd=root)
    noise = [line for line in (proc.stdout + proc.stderr).splitlines()
             if "deprecat" in line.lower() or "BuildBackendWarning" in line or "SetuptoolsWarning" in line]
    assert not noise, "building the wheel warned:\n" + "\n".join(noise)
    shutil.rmtree(root / "src")
    (built,) = (root / "dist").glob("selfspec-*.whl")
    return built


def test_the_wheel_carries_the_package_data_and_no_tests(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    for name in ("tune", "eval", "heldout", "external"):
        assert f"selfspec/data/prompts/{name}.jsonl" in names
    assert "selfspec/data/prompts/external.provenance.json" in names
    for model in ("tiny-base", "tiny-idlm", "tiny-idlm-lora", "tiny-jf", "tiny-c2i-student", "mnist-vq256"):
        assert any(n.startswith(f"selfspec/assets/{model}/") for n in names), model
    assert "selfspec/assets/tiny-base/model.safetensors" in names
    assert "selfspec/sglang_ext/cpu_compat/_shim/sgl_kernel/__init__.py" in names
    assert not [n for n in names if not n.startswith(("selfspec/", "selfspec-0"))]  # no tests/, bench/, docs/
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "selfspec = selfspec.sglang_ext.plugin:register" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_installed_from_the_wheel_selfspec_reads_its_data_from_the_install(wheel, tmp_path):
    """Installed with --no-deps into a venv over this environment's packages (the `.pth` line
    `make setup` uses), run from an empty directory: the package and its prompt sets come from
    the venv, and rebuilding an embedded model in place is refused."""
    sglang = importlib.util.find_spec("sglang")
    if sglang is None:
        pytest.fail("needs an environment with SGLang: run `make setup`")
    deps_site = Path(sglang.origin).parents[1]
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path)
    python = venv / "bin" / "python"
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     cwd=tmp_path).stdout.strip())
    (site / "_deps.pth").write_text(f"import site; site.addsitedir({str(deps_site)!r})\n")
    _run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", str(wheel)], cwd=tmp_path)

    cwd = tmp_path / "cwd"
    cwd.mkdir()
    probe = ("import selfspec; from selfspec.prompts import HELDOUT_PROMPTS, load_prompt_set; "
             "print(selfspec.__file__); print(len(load_prompt_set('tune')), len(load_prompt_set('eval')), "
             "len(load_prompt_set(str(HELDOUT_PROMPTS))), len(load_prompt_set('external')))")
    out = _run([str(python), "-c", probe], cwd=cwd).stdout.split("\n")
    assert out[0] == str(site / "selfspec" / "__init__.py")
    assert [int(n) for n in out[1].split()] == [160, 160, 128, 160]

    proc = subprocess.run([str(venv / "bin" / "selfspec"), "train", "tiny-idlm", "--no-measure"], cwd=cwd,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "source checkout" in proc.stderr and "--out" in proc.stderr, proc.stderr
    assert not list(cwd.iterdir())  # refused before writing anything


def test_run_outputs_and_recorded_paths_do_not_depend_on_where_selfspec_is(tmp_path, monkeypatch):
    """Work files go under the working directory; provenance names the package's files relative
    to the package's parent and work files relative to the working directory; a checkout may
    rebuild its embedded models in place, an installed package may not."""
    from selfspec import paths
    from selfspec.errors import UsageError
    from selfspec.training import recipes, tiny_base

    monkeypatch.chdir(tmp_path)
    assert str(paths.runs_dir("tiny-idlm")) == "runs/tiny-idlm"
    assert tiny_base.TinyBaseConfig().checkpoint_dir == "runs/tiny-base"
    assert recipes.RECIPES["tiny-idlm"].checkpoint_dir == "runs/tiny-idlm"
    assert recipes.SELFGEN["tiny-idlm"].file == Path("runs/selfgen/tiny-base-n8192.jsonl")
    assert paths.recorded_path(str(paths.PACKAGE_DIR / "assets" / "tiny-idlm")) == "selfspec/assets/tiny-idlm"
    assert paths.recorded_path(str(tmp_path / "runs" / "x")) == "runs/x"
    assert paths.recorded_path("/elsewhere/x") == "/elsewhere/x" and paths.recorded_path("stdlib") == "stdlib"
    assert recipes.HELDOUT_PROMPTS.is_relative_to(paths.PACKAGE_DIR)

    assert paths.source_checkout() == REPO  # the suite runs from a checkout
    paths.check_package_write(paths.PACKAGE_DIR / "assets" / "tiny-base", "selfspec train tiny-base")
    paths.check_package_write(tmp_path / "out", "selfspec train tiny-base")  # outside the package: fine
    monkeypatch.setattr(paths, "source_checkout", lambda: None)
    with pytest.raises(UsageError, match="installed package.*--out DIR"):
        paths.check_package_write(paths.PACKAGE_DIR / "assets" / "tiny-base", "selfspec train tiny-base")
