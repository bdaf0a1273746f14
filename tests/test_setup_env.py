"""`make setup` (scripts/setup_env.sh): the cached venv holds the dependencies only, and every
checkout gets its own `.venv` with its own selfspec, so two clones on one machine never run each
other's code. Checked on a real second clone of HEAD that reuses this checkout's cached venv."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PROBE = ("import importlib.metadata as m, selfspec; "
         "eps = [e for e in m.entry_points(group='sglang.srt.plugins') if e.name == 'selfspec']; "
         "dists = [d for d in m.distributions() if d.metadata['Name'] == 'selfspec']; "
         "print(selfspec.__file__, getattr(selfspec, 'CLONE_MARK', '-'), len(eps), eps[0].dist.locate_file(''), len(dists))")


def _shared_venv() -> Path:
    """The cached venv this checkout's .venv sits on (its setup marker), or skip."""
    marker = REPO / ".venv" / ".selfspec-deps"
    if not marker.is_file():
        pytest.fail("this checkout has no .venv made by `make setup`: run `make setup`")
    return Path(marker.read_text().split()[0])


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env or _env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{cmd} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def _probe(checkout: Path) -> list[str]:
    return _run([str(checkout / ".venv" / "bin" / "python"), "-c", PROBE], cwd=Path("/")).split()


@pytest.mark.multiprocess
def test_two_clones_each_run_their_own_code(tmp_path):
    shared = _shared_venv()
    clone = tmp_path / "clone"
    _run(["git", "clone", "--quiet", "--local", str(REPO), str(clone)], cwd=tmp_path)
    reqs = b"".join((clone / "requirements" / f).read_bytes() for f in ("cpu.txt", "sglang.txt"))
    if not (shared.parent / f"venv-{hashlib.sha256(reqs).hexdigest()[:16]}" / ".complete").exists():
        pytest.fail("HEAD's requirements differ from this checkout's cached venv: commit requirements/ "
                    "(setup would build a new venv)")
    try:
        with open(clone / "selfspec" / "__init__.py", "a") as f:
            f.write('CLONE_MARK = "clone"\n')
        (clone / ".venv").symlink_to(shared)  # what the old setup left: replaced, the target kept
        env = {**_env(), "SELFSPEC_VENV_ROOT": str(shared.parent)}
        out = _run(["bash", "scripts/setup_env.sh"], cwd=clone, env=env)
        assert "reusing" in out and not (clone / ".venv").is_symlink() and (shared / ".complete").exists()

        # each checkout's python, plugin entry point and console script run its own code
        mine = _probe(REPO)
        theirs = _probe(clone)
        assert mine[:2] == [str(REPO / "selfspec" / "__init__.py"), "-"], mine
        assert theirs[:2] == [str(clone / "selfspec" / "__init__.py"), "clone"], theirs
        for probe, root in ((mine, REPO), (theirs, clone)):
            assert probe[2] == "1" and probe[4] == "1", probe  # one plugin, one selfspec distribution
            assert Path(probe[3]).is_relative_to(root / ".venv"), probe
        assert str(clone / "selfspec" / "assets") in _run([str(clone / ".venv/bin/selfspec"), "models"], cwd=tmp_path)
        assert str(REPO / "selfspec" / "assets") in _run([str(REPO / ".venv/bin/selfspec"), "models"], cwd=tmp_path)
        # the shared venv holds no selfspec; its console scripts run with the clone's python
        deps_site = next(shared.glob("lib/python*/site-packages"))
        assert not list(deps_site.glob("selfspec-*.dist-info"))
        assert (clone / ".venv/bin/pytest").read_text().startswith(f"#!{clone}/.venv/bin/python")
        _run([str(clone / ".venv/bin/pytest"), "--version"], cwd=tmp_path)

        # again: nothing to do, quickly; an interrupted .venv is rebuilt
        installed = (clone / ".venv" / ".selfspec-install").stat().st_mtime_ns
        out = _run(["bash", "scripts/setup_env.sh"], cwd=clone, env=env)
        assert "rebuilding" not in out and (clone / ".venv" / ".selfspec-install").stat().st_mtime_ns == installed
        (clone / ".venv" / ".selfspec-deps").write_text("building\n")
        out = _run(["bash", "scripts/setup_env.sh"], cwd=clone, env=env)
        assert "rebuilding" in out and _probe(clone)[:2] == theirs[:2]
        # a .venv setup did not make is left alone
        shutil.rmtree(clone / ".venv")
        (clone / ".venv").mkdir()
        proc = subprocess.run(["bash", "scripts/setup_env.sh"], cwd=clone, env=env, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 1 and "move it away" in proc.stderr
    finally:
        shutil.rmtree(clone, ignore_errors=True)
