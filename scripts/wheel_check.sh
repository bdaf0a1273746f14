#!/usr/bin/env bash
# `make wheel-check`: selfspec installed like a plugin, the way users get it. Builds the wheel from
# a copy of this checkout (tracked and new files; nothing is built in the tree), installs it with
# --no-deps into a clean venv whose only other packages are the cached dependency venv's ("an
# environment that already has SGLang"), and from an empty working directory outside the
# repository: imports selfspec from that venv, lists the embedded models, loads the prompt sets,
# runs a short offline benchmark on the eval prompts, serves the installed tiny-idlm with stock
# `python -m sglang.launch_server ... --speculative-algorithm ISD` and asks it for one
# completion. Then checks that the repository is unchanged and that the outputs are in that
# working directory. About 3 minutes on 2 cores, most of it the server's start.
#   KEEP=1 bash scripts/wheel_check.sh   # keep the work directory (wheel, venv, outputs, logs)
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD

if [ ! -f .venv/.selfspec-deps ]; then
  echo "wheel-check: no .venv made by setup here; run \`make setup\` first" >&2
  exit 1
fi
deps=$(cut -d' ' -f1 .venv/.selfspec-deps)
deps_site=$("$deps/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
work=$(mktemp -d "${TMPDIR:-/tmp}/selfspec-wheel-check.XXXXXX")
server=""
cleanup() {
  if [ -n "$server" ]; then kill -- -"$server" 2> /dev/null || true; fi
  if [ "${KEEP:-0}" = 1 ]; then echo "wheel-check: kept $work"; else rm -rf "$work"; fi
}
trap cleanup EXIT
step() { echo "wheel-check: $*"; }
# tracked, new and ignored files (build/, *.egg-info, runs/ would show), less what tests and
# interpreters leave anyway
repo_state() {
  git -C "$repo" status --porcelain --ignored --untracked-files=all \
    | grep -v -e '__pycache__/' -e '^!! \.venv/' -e '^!! \.hypothesis/' -e '^!! \.pytest_cache/' || true
}
before=$(repo_state)

step "building the wheel from a copy of the checkout"
mkdir -p "$work/src" "$work/dist" "$work/cwd"
git ls-files -z --cached --others --exclude-standard \
  | while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done \
  | tar --null -T - -cf - | tar -xf - -C "$work/src"
"$deps/bin/python" -m pip wheel --quiet --no-deps --no-build-isolation -w "$work/dist" "$work/src" 2>&1 \
  | tee "$work/wheel.log"
if grep -i -E 'warning|deprecat' "$work/wheel.log"; then
  echo "wheel-check: building the wheel printed warnings (above)" >&2
  exit 1
fi
wheel=$(ls "$work"/dist/selfspec-*.whl)
"$deps/bin/python" - "$wheel" <<'EOF'
import sys
import zipfile

names = zipfile.ZipFile(sys.argv[1]).namelist()
need = [f"selfspec/data/prompts/{s}.jsonl" for s in ("tune", "eval", "heldout")]
need += ["selfspec/assets/tiny-idlm/config.json", "selfspec/assets/tiny-idlm/selfspec.json",
         "selfspec/assets/tiny-base/model.safetensors", "selfspec/sglang_ext/plugin.py"]
missing = [n for n in need if n not in names]
stray = [n for n in names if not n.startswith(("selfspec/", "selfspec-"))]
assert not missing and not stray, f"missing {missing}, not in the package {stray}"
print(f"wheel-check: {sys.argv[1].rsplit('/', 1)[-1]}: {len(names)} files, "
      f"{sum(n.startswith('selfspec/assets/') for n in names)} of them embedded-model files")
EOF

step "installing it with --no-deps into a clean venv over the dependency venv"
"$deps/bin/python" -m venv --without-pip "$work/venv"
site=$("$work/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "import site; site.addsitedir('$deps_site')" > "$site/_deps.pth"
"$work/venv/bin/python" -m pip install --quiet --no-deps "$wheel"
py="$work/venv/bin/python"
selfspec="$work/venv/bin/selfspec"

cd "$work/cwd"
step "from $PWD"
"$py" - "$site" <<'EOF'
import importlib.metadata as m
import sys

import selfspec

assert selfspec.__file__.startswith(sys.argv[1] + "/"), selfspec.__file__
plugins = [e for e in m.entry_points(group="sglang.srt.plugins") if e.name == "selfspec"]
assert len(plugins) == 1 and str(plugins[0].dist.locate_file("")) == sys.argv[1], plugins
print(f"wheel-check: import selfspec -> {selfspec.__file__}; one sglang.srt.plugins entry point")
EOF
"$selfspec" models
"$py" -c '
from selfspec.prompts import HELDOUT_PROMPTS, SET_NAMES, load_prompt_set
sets = {name: len(load_prompt_set(name)) for name in SET_NAMES}
sets["heldout"] = len(load_prompt_set(str(HELDOUT_PROMPTS)))
print("wheel-check: prompt sets", sets)
'
if "$selfspec" train tiny-base > train.log 2>&1; then
  echo "wheel-check: \`selfspec train tiny-base\` ran in an installed package" >&2
  exit 1
fi
if ! grep -q "source checkout" train.log; then
  cat train.log >&2
  exit 1
fi
step "selfspec train tiny-base refuses to write into the installed package: $(tail -1 train.log)"

step "selfspec bench offline on the eval prompts"
"$selfspec" bench offline --model tiny-idlm --modes ar,isd --prompts eval --limit 2 --max-new-tokens 16 \
  --threads 1 --json bench-offline.json

port=$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
step "python -m sglang.launch_server --model-path <installed>/selfspec/assets/tiny-idlm --speculative-algorithm ISD"
setsid "$py" -m sglang.launch_server --model-path "$site/selfspec/assets/tiny-idlm" --speculative-algorithm ISD \
  --host 127.0.0.1 --port "$port" > server.log 2>&1 &
server=$!
"$py" - "$port" "$server" <<'EOF'
import json
import os
import sys
import time
import urllib.request

port, pid = sys.argv[1], int(sys.argv[2])
base = f"http://127.0.0.1:{port}"
deadline = time.time() + 900
while True:
    try:
        with urllib.request.urlopen(base + "/health", timeout=5) as r:
            if r.status == 200:
                break
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        sys.exit("wheel-check: the server exited; see server.log")
    if time.time() > deadline:
        sys.exit("wheel-check: the server did not start in 15 minutes; see server.log")
    time.sleep(2)
req = urllib.request.Request(base + "/v1/completions", headers={"Content-Type": "application/json"}, data=json.dumps(
    {"model": "default", "prompt": "def fib(n):", "max_tokens": 24, "temperature": 0}).encode())
with urllib.request.urlopen(req, timeout=300) as r:
    text = json.loads(r.read())["choices"][0]["text"]
assert text, "empty completion"
print(f"wheel-check: completion of 'def fib(n):' -> {text!r}")
EOF
grep -m1 -F "[selfspec]" server.log || true  # the plugin's line on a machine without an accelerator
kill -- -"$server" 2> /dev/null || true
wait "$server" 2> /dev/null || true
server=""

for out in bench-offline.json server.log train.log; do
  [ -s "$out" ] || { echo "wheel-check: $out was not written in $PWD" >&2; exit 1; }
done
step "outputs in $PWD: $(ls | tr '\n' ' ')"
after=$(repo_state)
if [ "$before" != "$after" ]; then
  echo "wheel-check: the repository changed during the check (by it, or by someone editing meanwhile):" >&2
  diff <(echo "$before") <(echo "$after") >&2 || true
  exit 1
fi
step "the repository is unchanged; all checks passed"
