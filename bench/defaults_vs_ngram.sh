#!/usr/bin/env bash
# The README's serving results: every mode at its defaults (no plan file) beside stock AR and
# SGLang's NGRAM, interleaved, on the eval prompts and on HumanEval, greedy and T=0.7, and greedy
# on the held-out `external` set, three runs each (RISD at T=0.7: one). About four and a half
# hours on 2 CPU cores; run nothing else meanwhile. Each set's runs are kept together in one runs
# file, OUT/SET.json (bench/median_table.py --save-runs; the single reports go to WORK,
# runs/defaults-vs-ngram/), and OUT/README.md gets their median tables. Where the speed comes
# from: `selfspec bench serve --breakdown`, or `make demo`.
#
#   bash bench/defaults_vs_ngram.sh [OUT_DIR] [RUNS] [SET ...]   # SET: some of the sets below
#   bash bench/defaults_vs_ngram.sh --tables [OUT_DIR]    # only OUT/README.md, from OUT's runs files
set -euo pipefail
cd "$(dirname "$0")/.."
tables_only=0
if [[ ${1:-} == --tables ]]; then tables_only=1; shift; fi
out=${1:-bench/results/defaults}
runs=${2:-3}
work=${WORK:-runs/defaults-vs-ngram}
sets=(greedy-eval greedy-humaneval greedy-external t07-eval t07-humaneval risd-greedy-eval
      risd-greedy-humaneval risd-t07-eval risd-t07-humaneval)
if (( $# > 2 )); then run_sets=("${@:3}"); else run_sets=("${sets[@]}"); fi
for set in "${run_sets[@]}"; do
  [[ " ${sets[*]} " == *" $set "* ]] || { echo "unknown set $set: choose from ${sets[*]}" >&2; exit 2; }
done
mkdir -p "$out"

if (( ! tables_only )); then
  mkdir -p "$work"
  bench() { .venv/bin/selfspec bench serve --concurrency 1,4,16,32 --num-prompts 32 --max-tokens 128 \
              --interleave 2 --genai-bench off "$@"; }
  # set -> the bench serve arguments of its runs (the prompt set is the name's last part)
  declare -A args=(
    [greedy]="--model tiny-idlm --modes ar,ngram,isd,jacobi,sjd"
    [t07]="--model tiny-idlm --temperature 0.7 --modes ar,ngram,isd,sjd"
    [risd-greedy]="--model tiny-idlm-lora --modes ar,ngram,risd"
    [risd-t07]="--model tiny-idlm-lora --temperature 0.7 --modes ar,ngram,risd"
  )
  for i in $(seq 1 "$runs"); do
    for set in "${run_sets[@]}"; do
      [[ $set == risd-t07-* && $i -gt 1 ]] && continue  # one run: see the header
      rm -f "$work/$set-$i.json"
      # shellcheck disable=SC2086
      bench ${args[${set%-*}]} --prompts "${set##*-}" --json "$work/$set-$i.json"
    done
  done
  for set in "${run_sets[@]}"; do
    .venv/bin/python bench/median_table.py "$work"/$set-[0-9]*.json --save-runs "$out/$set.json" > /dev/null
  done
fi

# the medians, one table per set (bench/results/defaults/README.md)
{
  echo "# Every mode at its defaults beside stock AR and SGLang's NGRAM"; echo
  echo "Written by \`bash bench/defaults_vs_ngram.sh\` (tiny-idlm; RISD on tiny-idlm-lora, whose AR row is"
  echo "tiny-base): 32 prompts per concurrency level × 128 tokens, \`--interleave 2\`, 2 shared CPU cores,"
  echo "median of the runs of each set (\`SET.json\` in this folder holds them all). Cell: output tok/s ×"
  echo "AR (non-looping × AR) [× NGRAM / non-looping × NGRAM]. Rows named \`*-tuned\`, where present,"
  echo "served plans of the tuner that preceded \`selfspec tune\`: within the run-to-run noise of the"
  echo "defaults, which is why that tuner was cut. SGLang's NGRAM on CPU commits argmax tokens at any"
  echo "temperature (\`eagle_utils._verify_uses_greedy\`), so its T=0.7 rows are greedy decoding, not"
  echo "sampling."; echo
  for set in "${sets[@]}"; do
    [[ -f $out/$set.json ]] || continue
    echo "### $set"; echo
    .venv/bin/python bench/median_table.py "$out/$set.json" --markdown; echo
  done
} > "$out/README.md"
