#!/usr/bin/env bash
# The README's serving results: every mode at its defaults (no plan file) beside stock AR and
# SGLang's NGRAM, interleaved, on the eval prompts and on HumanEval, greedy and T=0.7, three runs
# each; then the breakdown of ISD's default on HumanEval. About four hours on 2 CPU cores; run
# nothing else meanwhile. Tables: python bench/median_table.py OUT/greedy-eval-{1,2,3}.json
#
#   bash bench/defaults_vs_ngram.sh [OUT_DIR] [RUNS]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench/results/defaults}
runs=${2:-3}
mkdir -p "$out"
bench() { .venv/bin/selfspec bench serve --concurrency 1,4,16,32 --num-prompts 32 --max-tokens 128 \
            --interleave 2 --genai-bench off "$@"; }
main=(--model tiny-idlm --modes ar,ngram,isd,jacobi,sjd)
sampled=(--model tiny-idlm --temperature 0.7 --modes ar,ngram,isd,sjd)
risd=(--model tiny-idlm-lora --modes ar,ngram,risd)
for i in $(seq 1 "$runs"); do
  for p in eval humaneval; do
    bench "${main[@]}" --prompts "$p" --json "$out/greedy-$p-$i.json"
    bench "${risd[@]}" --prompts "$p" --json "$out/risd-greedy-$p-$i.json"
    bench "${sampled[@]}" --prompts "$p" --json "$out/t07-$p-$i.json"
  done
done
for p in eval humaneval; do
  bench "${risd[@]}" --temperature 0.7 --prompts "$p" --json "$out/risd-t07-$p.json"
done
bench --model tiny-idlm --modes ar,ngram,isd --breakdown --prompts humaneval --json "$out/breakdown-greedy-humaneval.json"
bench --model tiny-idlm --modes ar,ngram,isd --breakdown --prompts humaneval --temperature 0.7 \
  --json "$out/breakdown-t07-humaneval.json"
# the medians, one table per set (bench/results/defaults/README.md)
{
  echo "# Every mode at its defaults beside stock AR and SGLang's NGRAM"; echo
  echo "Written by \`bash bench/defaults_vs_ngram.sh\`: median of the runs in this folder. Cell: output"
  echo "tok/s x AR (non-looping x AR) [x NGRAM / non-looping x NGRAM]. SGLang's NGRAM on CPU commits"
  echo "argmax tokens at any temperature (eagle_utils._verify_uses_greedy): its T=0.7 rows are greedy."; echo
  for set in greedy-eval greedy-humaneval t07-eval t07-humaneval risd-greedy-eval risd-greedy-humaneval; do
    echo "### $set"; echo
    .venv/bin/python bench/median_table.py "$out"/$set-[0-9]*.json --markdown; echo
  done
  for p in eval humaneval; do
    echo "### risd-t07-$p"; echo
    .venv/bin/python bench/median_table.py "$out/risd-t07-$p.json" --markdown; echo
  done
} > "$out/README.md"
