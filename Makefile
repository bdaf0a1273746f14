# The two commands of the README: `make demo` (the main job) and `make test`; `make results`
# regenerates bench/results/; `make wheel-check` installs the wheel like a user would.
.PHONY: setup demo test results wheel-check

setup:
	@bash scripts/setup_env.sh

demo: setup
	.venv/bin/python -m selfspec.demo

# Two pytest-xdist workers: servers and multi-process trainings run one at a time on one of them
# (tests/conftest.py), the other modules on the other. TEST_WORKERS=0 runs everything in-process.
TEST_WORKERS ?= 2

test: setup
	.venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 -n $(TEST_WORKERS) --dist loadgroup

# The wheel installed with --no-deps into a clean venv over the dependency venv, used from an
# empty directory outside the repository: models, prompt sets, an offline benchmark and one
# completion from `python -m sglang.launch_server ... --speculative-algorithm ISD` (about 3 min).
wheel-check: setup
	@bash scripts/wheel_check.sh

# Every file under bench/results/, regenerated one topic after another by the committed bench
# commands with the arguments that made it: about 8 hours on 2 shared CPU cores (times below are
# per line, on those cores); run nothing else meanwhile. Work files go to runs/. The docs quoting
# the numbers are not rewritten.
SELFSPEC := .venv/bin/selfspec
PY := .venv/bin/python
R := bench/results
TUNE := $(SELFSPEC) bench serve --model tiny-idlm --prompts tune --num-prompts 32 --max-tokens 128 --genai-bench off
FW := --selfspec-config bench/fixed_widths

results: setup
	@mkdir -p runs
# policy/: the tune-prompt runs behind the default policy's constants (docs/serving.md), about 10 min each
	$(TUNE) --concurrency 1,2,4 --interleave 2 --modes ar,ngram,isd-s2=isd,isd-s3=isd,lookup16=isd,jacobi16=jacobi,sjd16=sjd \
	  --mode-args "isd-s2=$(FW)/own16-isd.yaml" --mode-args "isd-s3=$(FW)/own16-isd-stride3.yaml" \
	  --mode-args "lookup16=$(FW)/lookup16.yaml" --mode-args "jacobi16=$(FW)/own16-jacobi.yaml" \
	  --mode-args "sjd16=$(FW)/own16-sjd.yaml" --json $(R)/policy/tune-greedy-small-batches.json
	$(TUNE) --concurrency 4,8,16,32 --interleave 2 --modes ar,ngram,lookup16=isd,lookup12ca=isd,lookup8ca=isd,lookup4=isd \
	  --mode-args "lookup16=$(FW)/lookup16.yaml" --mode-args "lookup12ca=$(FW)/lookup12ca.yaml" \
	  --mode-args "lookup8ca=$(FW)/lookup8ca.yaml" --mode-args "lookup4=$(FW)/lookup4.yaml" \
	  --json $(R)/policy/tune-greedy-wide-batches.json
	$(TUNE) --concurrency 1,2 --interleave 2 --modes ar,ngram,lookup16=jacobi,jacobi16=jacobi,jb4=jacobi,jb4v2=jacobi \
	  --mode-args "lookup16=$(FW)/lookup16.yaml" --mode-args "jacobi16=$(FW)/own16-jacobi.yaml" \
	  --mode-args "jb4=$(FW)/own16-jacobi-b4.yaml" --mode-args "jb4v2=$(FW)/own16-jacobi-b4v2.yaml" \
	  --json $(R)/policy/tune-greedy-jacobi-own-step.json
	$(TUNE) --concurrency 1,4,16,32 --interleave 2 --modes ar,ngram,isd,l32x2=isd,l16x1a=isd,own32x2=isd \
	  --mode-args "l32x2=$(FW)/lookup32x2.yaml" --mode-args "l16x1a=$(FW)/lookup16x1a.yaml" \
	  --mode-args "own32x2=$(FW)/own32x2-isd.yaml" --json $(R)/policy/tune-greedy-draft-length.json
	$(TUNE) --concurrency 4,16 --interleave 2 --modes ar,ngram,isd,isd-b2=isd \
	  --mode-args "isd-b2=$(FW)/policy-branches2-isd.yaml" --json $(R)/policy/tune-greedy-branches.json
	$(TUNE) --temperature 0.7 --concurrency 1,4,16 --interleave 2 --modes ar,isd-arsteps=isd,isd-s2c4=isd,sjd-c4=sjd,isd,sjd \
	  --mode-args "isd-arsteps=--selfspec-policy ar" --mode-args "isd-s2c4=$(FW)/isd-stride2c4.yaml" \
	  --mode-args "sjd-c4=$(FW)/sjd-c4.yaml" --json $(R)/policy/tune-t07.json
	$(TUNE) --temperature 0.7 --concurrency 1,4,16,32 --interleave 1 --modes ar,ngram,isd,lk12s=isd,lk4s=isd \
	  --mode-args "lk12s=$(FW)/lookup12x1a-sampled.yaml" --mode-args "lk4s=$(FW)/lookup4-sampled.yaml" \
	  --json $(R)/policy/tune-t07-lookup.json
# policy/: selfspec's context candidates vs SGLang's NGRAM drafter, replayed without forwards (about a minute)
	$(PY) bench/context_lookup.py --prompts tune,eval,humaneval,external --tokens 4,12 --length-factors 1 --tree-budgets 4,11 \
	  --json $(R)/policy/lookup-vs-ngram-drafter.json
# policy/tree-vs-chain.json: every mode's default (the long lookup a draft tree) beside the chain it replaced,
# stock AR and NGRAM, greedy, one interleaved run per prompt set (about 12 min each), the sets in one file
	for p in eval humaneval external; do $(SELFSPEC) bench serve --model tiny-idlm --prompts $$p --concurrency 1,4,16,32 \
	  --num-prompts 32 --max-tokens 128 --interleave 2 --modes ar,ngram,isd,jacobi,sjd,isd-chain=isd \
	  --mode-args "isd-chain=$(FW)/policy-chain-isd.yaml" --genai-bench off --json runs/tree-vs-chain-$$p.json; done
	$(PY) bench/median_table.py runs/tree-vs-chain-{eval,humaneval,external}.json --save-runs $(R)/policy/tree-vs-chain.json
# policy/tune-greedy-tree-wide.json: the draft tree past 18 requests too, against the narrow 4-token lookup,
# tune prompts, C = 24 / 32, 3 interleaved runs (about 12 min)
	for i in 1 2 3; do $(SELFSPEC) bench serve --model tiny-idlm --prompts tune --concurrency 24,32 --num-prompts 64 \
	  --max-tokens 128 --interleave 2 --modes ngram,isd,isd-wide=isd --mode-args "isd-wide=$(FW)/policy-tree-wide-isd.yaml" \
	  --genai-bench off --json runs/tune-tree-wide-$$i.json; done
	$(PY) bench/median_table.py runs/tune-tree-wide-[123].json --save-runs $(R)/policy/tune-greedy-tree-wide.json > /dev/null
# policy/tune-greedy-wide-length.json: the narrow lookup past 18 requests, 12 tokens cut to the match's length
# (the default) against a fixed 4, tune prompts, C = 24 / 32, 3 interleaved runs (about 12 min)
	for i in 1 2 3; do $(SELFSPEC) bench serve --model tiny-idlm --prompts tune --concurrency 24,32 --num-prompts 64 \
	  --max-tokens 128 --interleave 2 --modes ngram,isd,isd-w4=isd --mode-args "isd-w4=$(FW)/policy-wide4-isd.yaml" \
	  --genai-bench off --json runs/tune-wide-length-$$i.json; done
	$(PY) bench/median_table.py runs/tune-wide-length-[123].json --save-runs $(R)/policy/tune-greedy-wide-length.json > /dev/null
# lookup-step-breakdown.json: the draft tree's lookup step phase by phase beside NGRAM's, 32 requests (about 5 min)
	$(PY) bench/step_breakdown.py --servers ngram,lookup-tree --concurrency 32 --temperature 0 --prompts external \
	  --num-prompts 96 --py-spy --json $(R)/lookup-step-breakdown.json
# defaults/: every mode at its defaults vs stock AR and NGRAM, 3 runs per set (about 4 h)
	bash bench/defaults_vs_ngram.sh $(R)/defaults 3
# defaults/t07-c1-humaneval.json: T=0.7 at C=1, the default beside stock AR and the worker's AR
# steps, 3 interleaved runs (about 15 min)
	for i in 1 2 3; do $(SELFSPEC) bench serve --model tiny-idlm --temperature 0.7 --prompts humaneval \
	  --concurrency 1 --num-prompts 32 --max-tokens 128 --interleave 2 --modes ar,isd,sjd,worker-ar=isd \
	  --mode-args "worker-ar=--selfspec-policy ar" --genai-bench off --json runs/t07-c1-$$i.json; done
	$(PY) bench/median_table.py runs/t07-c1-[123].json --save-runs $(R)/defaults/t07-c1-humaneval.json > /dev/null
# ar-step-breakdown.json: a plain AR step phase by phase, stock SGLang beside the worker's, T=0.7, C=1 (about 8 min)
	$(PY) bench/step_breakdown.py --py-spy --json $(R)/ar-step-breakdown.json
# growth.json / growth.png: ms per step of each kind as the prompt grows 256 -> 2,048 tokens, C = 1 / 16 / 64 (about 20 min)
	$(PY) bench/growth.py --prompt-tokens 256,1024,2048 --output-tokens 128 --concurrency 1,16,64 \
	  --modes ar,ngram,worker-ar,isd-s2,lookup-tree11,sjd-own --json $(R)/growth.json --plot $(R)/growth.png
# step-costs.json: served step costs per kind of step at C = 1, 4, 16, 32, T=0.7 (about 12 min)
	$(PY) bench/step_costs.py --json $(R)/step-costs.json
# serve-tiny-jf.json: tiny-jf served by stock SGLang, AR / NGRAM / JACOBI (about 10 min)
	$(SELFSPEC) bench serve --modes ar,ngram,jacobi --model tiny-jf --concurrency 1,4,16 --num-prompts 16 \
	  --max-tokens 128 --prompts selfspec/data/prompts/heldout.jsonl --genai-bench off --json $(R)/serve-tiny-jf.json
# jf-ablation.json: tiny-jf's round-1 trajectories (tiny-base, n = 8; about 15 min), then 6 arms (about 25 min)
	$(SELFSPEC) train jf-trajectories --model tiny-base --out runs/tiny-jf/round-1/trajectories --block-size 8 \
	  --num-prompts 2048 --threads 2
	$(PY) bench/jf_ablation.py --steps 100 --num-prompts 16 --json $(R)/jf-ablation.json \
	  --arms progressive:nc,random:nc,reverse:nc,progressive:nc_ic,progressive:cllm,progressive:nc:16
# jf-sweep/: the tiny-jf recipe's trade-off, anchor weight x steps, one round on the trajectories above, then
# two arms without the AR CE on the model's own trajectories; the pick fitted on the tune prompts (about 50 min)
	$(PY) bench/jf_sweep.py --anchors 8,16,32,64 --steps 360 --points 3 --num-prompts 32 --prompts tune,heldout,humaneval \
	  --json $(R)/jf-sweep/sweep.json --plot $(R)/jf-sweep/sweep.png
	$(PY) bench/jf_sweep.py --append --anchors 16:0,8:0 --steps 360 --points 3 --num-prompts 32 \
	  --prompts tune,heldout,humaneval --json $(R)/jf-sweep/sweep.json --plot $(R)/jf-sweep/sweep.png
# grammar-proposals.json: grammar-masked vs raw ISD proposals under structured output (a few minutes)
	$(PY) bench/grammar_proposals.py --json $(R)/grammar-proposals.json
# fuzz-soak*.json: the fuzz soak, 1,120 requests per server (about 30 min), and SJD under retraction (about 5 min)
	$(PY) bench/fuzz_soak.py --seeds 0-15 --size 64 --modes isd,isd-default,risd,jacobi,sjd --json $(R)/fuzz-soak.json
	$(PY) bench/fuzz_soak.py --seeds 0-3 --size 64 --modes sjd-retract --json $(R)/fuzz-soak-retract.json
# images/: sample quality and sampled grids of the teacher (about 10 min) and the student (about 5 min);
# greedy grids (--temperature 0; generate-image samples by default) of cached AR and HB-SJD from the
# same prefixes, the same PNG byte for byte (seconds)
	$(SELFSPEC) eval-images --model tiny-c2i-teacher --num 2000 --cfg 2.0 --out $(R)/images/teacher-samples.png \
	  --json $(R)/images/teacher-eval.json
	$(SELFSPEC) eval-images --model tiny-c2i-student --num 5000 --cfg 2.0 --out $(R)/images/student-samples.png \
	  --json $(R)/images/student-eval.json
	$(SELFSPEC) generate-image --model tiny-c2i-student --mode ar --prefix-ratio 0.5 --num 20 --temperature 0 \
	  --out $(R)/images/student-ar-prefix0.5.png
	$(SELFSPEC) generate-image --model tiny-c2i-student --mode hbsjd --prefix-ratio 0.5 --num 20 --temperature 0 \
	  --out $(R)/images/student-hbsjd-prefix0.5.png
# rollout-student/, rollout-teacher/: HB-SJD rollouts against cached AR and the batch-synchronous
# schedules, with sweeps (about 10 min and 3 min)
	$(SELFSPEC) bench rollout --model tiny-c2i-student --batch 8,16,32,64 --window 8 --repeats 3 --threads 1 \
	  --out $(R)/rollout-student
	$(SELFSPEC) bench rollout --model tiny-c2i-teacher --batch 8,32 --window 8 --repeats 1 --threads 1 \
	  --verify greedy --sweeps w --out $(R)/rollout-teacher
# opd-compare/: on-policy distillation with AR vs HB-SJD rollouts, greedy then sampled (about 30 min
# each; the table they print goes to runs/), and the distilled student's quality (about 5 min)
	$(SELFSPEC) train opd-compare --out runs/opd-compare > runs/opd-compare.log
	cp runs/opd-compare/compare.json $(R)/opd-compare/greedy.json
	$(SELFSPEC) train opd-compare --out runs/opd-compare-prob --verify prob > runs/opd-compare-prob.log
	cp runs/opd-compare-prob/compare.json $(R)/opd-compare/prob.json
	$(SELFSPEC) eval-images --model runs/opd-compare/hbsjd/model --num 2000 --cfg 2.0 \
	  --out $(R)/images/opd-student-samples.png --json $(R)/images/opd-student-eval.json
# defaults/README.md: the median tables of the defaults runs (seconds)
	bash bench/defaults_vs_ngram.sh --tables $(R)/defaults
