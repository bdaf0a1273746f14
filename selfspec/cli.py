"""`selfspec` command line: models, generate, serve, train, bench, tune."""

from __future__ import annotations

import argparse
import sys

from selfspec.errors import UsageError, UserError
from selfspec.serving import split_passthrough


def _cmd_models(args: argparse.Namespace) -> int:
    from selfspec.models import embedded_models

    for info in embedded_models():
        state = "" if info.present else "  (missing: rebuild with `selfspec train " + info.name + "`)"
        print(f"{info.name:16s} {info.path}{state}")
        print(f"{'':16s} {info.description}")
        prov = info.provenance()
        if prov and prov.get("heldout_perplexity"):
            print(f"{'':16s} held-out perplexity {prov['heldout_perplexity']:.1f}, "
                  f"{prov.get('tokens_seen', 0) / 1e6:.1f}M tokens, {prov.get('total_seconds', 0) / 60:.0f} min to train")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    import time

    import torch

    from selfspec.decoding import registry
    from selfspec.decoding.requests.sampling import SamplingParams
    from selfspec.engines.hf import HFEngine

    # everything a flag can get wrong is checked before the model loads
    try:
        sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
        options = registry.parse_option_string(args.mode_config)
        registry.parse_mode_config(args.mode, options)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if registry.get(args.mode).greedy_only and not sampling.greedy:
        sampled = ", ".join(s.name for s in registry.MODES.values() if not s.greedy_only)
        raise UsageError(f"--mode {args.mode} is greedy only: use --temperature 0, or a sampling mode ({sampled})")
    engine = HFEngine.from_pretrained(args.model, dtype=torch.float32)
    tok = engine.tokenizer
    if args.chat:
        text = tok.apply_chat_template([{"role": "user", "content": args.prompt}], tokenize=False,
                                       add_generation_prompt=True)
    else:
        text = args.prompt
    prompt_ids = tok(text, add_special_tokens=False)["input_ids"]
    started = time.perf_counter()
    (out,) = engine.generate([prompt_ids], max_new_tokens=args.max_new_tokens, sampling=sampling,
                             seed=args.seed, mode=args.mode, mode_config=options or None)
    elapsed = time.perf_counter() - started
    print(tok.decode(out.token_ids, skip_special_tokens=True))
    n = len(out.token_ids)
    print(f"\n[{n} tokens, finish={out.finish_reason}, {n / max(elapsed, 1e-9):.1f} tok/s, mode={args.mode}, "
          f"{out.metrics.tokens_per_forward:.2f} tokens per forward]", file=sys.stderr)
    return 0


def _cmd_serve(args: argparse.Namespace, extra: list[str]) -> int:
    import subprocess

    from selfspec.serving import ServerSpec

    argv, env = ServerSpec(args.model, host=args.host, port=args.port, extra_args=extra).command()
    print("launching: " + " ".join(argv), file=sys.stderr)
    # Stays in the foreground: Ctrl-C reaches SGLang, which shuts down its own children.
    return subprocess.call(argv, env=env)


def _add_command(subparsers, name: str, help: str, module) -> None:
    """A subcommand whose options and behaviour live in `module` (its docstring is the --help text)."""
    p = subparsers.add_parser(name, help=help, description=module.__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    module.add_arguments(p)
    p.set_defaults(func=module.run)


def build_parser() -> argparse.ArgumentParser:
    from selfspec.decoding import registry

    parser = argparse.ArgumentParser(
        prog="selfspec",
        description="Self-speculative parallel decoding (ISD, RISD, JACOBI, SJD) for SGLang, and its training package.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("models", help="list the embedded models and where they are on disk")
    p.set_defaults(func=_cmd_models)

    p = sub.add_parser("generate", help="generate with the Hugging Face reference engine")
    p.add_argument("--model", required=True, help="embedded model name (see `selfspec models`) or checkpoint directory")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--mode", default="ar", choices=registry.MODE_NAMES, metavar="MODE",
                   help="decoding mode (default ar): " + registry.help_text())
    p.add_argument("--mode-config", default=None, metavar="K=V,...",
                   help="the mode's options, e.g. stride=3,tau=0.5 (isd/risd), block_size=16 (jacobi), window=4 (sjd); "
                   "options: " + "; ".join(f"{s.name}: {', '.join(s.defaults)}" for s in registry.MODES.values()
                                          if s.config_class is not None))
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default), else > 0")
    p.add_argument("--top-k", type=int, default=0, help="0 = off, else at least 1")
    p.add_argument("--top-p", type=float, default=1.0, help="in (0, 1]; 1.0 = off")
    p.add_argument("--seed", type=int, default=None)
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser(
        "serve",
        help="serve a model with stock SGLang and the selfspec plugin",
        description="Launch `python -m sglang.launch_server` on a model. Without CUDA the CPU settings are added "
        "(SGLANG_USE_CPU_ENGINE=1, --device cpu, --attention-backend torch_native, a bounded --max-total-tokens, "
        "--skip-server-warmup, --dtype float32). Arguments after `--` go to SGLang unchanged, e.g. "
        "`selfspec serve --model tiny-base -- --speculative-algorithm NGRAM`.",
    )
    p.add_argument("--model", default="tiny-base", help="embedded model name or checkpoint directory (default tiny-base)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.set_defaults(func=_cmd_serve, takes_extra=True)

    train = sub.add_parser("train", help="training recipes").add_subparsers(dest="recipe", required=True, metavar="RECIPE")
    p = train.add_parser("tiny-base", help="train the embedded tokenizer + ~5M-parameter Qwen3 on the stdlib sources",
                         description="Trains a byte-level BPE tokenizer and a Qwen3-architecture causal LM on this "
                         "interpreter's standard-library sources and exports bf16 safetensors with provenance.json.")
    from selfspec.training import recipes, tiny_base
    from selfspec.training.idlm import objective as idlm

    tiny_base.add_arguments(p)
    p.set_defaults(func=tiny_base.run)

    p = train.add_parser("idlm", help="convert a causal LM into an introspective (I-DLM) model: full or gated-LoRA",
                         description=idlm.__doc__)
    idlm.add_arguments(p)
    p.set_defaults(func=idlm.run)
    for name in recipes.RECIPES:
        p = train.add_parser(name, help=f"rebuild the embedded {name} from its committed recipe")
        recipes.add_arguments(p)
        p.set_defaults(func=recipes.run, recipe=name)

    from selfspec.training.jacobi_forcing import objective as jacobi_forcing
    from selfspec.training.jacobi_forcing import recipe as jf_recipe
    from selfspec.training.jacobi_forcing import trajectories

    _add_command(train, "jf", "Jacobi Forcing: train a causal LM on its own Jacobi trajectories (for JACOBI)",
                 jacobi_forcing)
    _add_command(train, "jf-trajectories", "record a model's greedy Jacobi trajectories (Jacobi Forcing data)",
                 trajectories)
    _add_command(train, jf_recipe.NAME, f"rebuild the embedded {jf_recipe.NAME} from its committed recipe", jf_recipe)

    from selfspec.images import gpt as image_gpt
    from selfspec.images import tokenizer as image_tokenizer

    _add_command(train, "mnist-vq", "fit the image tokenizer (2x2 patch k-means, 256 codes) on the real digits",
                 image_tokenizer)
    _add_command(train, "image-gpt", "train a class-conditional image-token GPT on the real digits", image_gpt)
    from selfspec.images import opd

    _add_command(train, "opd", "visual on-policy distillation (GKD / VarKD-style) with an AR or HB-SJD rollout backend",
                 opd)
    from selfspec.images import opd_compare

    _add_command(train, "opd-compare", "the OPD comparison run: the same distillation with AR and with HB-SJD rollouts",
                 opd_compare)
    from selfspec.images import evaluate as image_eval

    p = train.add_parser("digits-classifier", help="train the digits CNN whose features give FID / IS / precision / recall",
                         description=image_eval.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    image_eval.add_classifier_arguments(p)
    p.set_defaults(func=image_eval.run_classifier)
    for name in image_gpt.RECIPES:
        p = train.add_parser(name, help=f"rebuild the embedded {name} from its committed recipe",
                             description=image_gpt.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
        image_gpt.add_recipe_arguments(p)
        p.set_defaults(func=image_gpt.run_recipe, recipe=name)

    from selfspec.images import generate as images

    _add_command(sub, "generate-image", "sample digits from an image-token model (cached AR or HB-SJD) as a PNG grid",
                 images)

    _add_command(sub, "eval-images", "image quality of an image-token model: FID, IS, precision / recall, class accuracy",
                 image_eval)

    from selfspec.training import export

    p = sub.add_parser("export", help="export a training checkpoint as an SGLang-ready model (weights + selfspec.json)")
    export.add_arguments(p)
    p.set_defaults(func=export.run)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True, metavar="BENCH")
    from selfspec.benchmarks import offline, serve

    _add_command(bench, "offline", "offline decoding benchmark on the HF engine (TPF, tok/s, ratio to AR)", offline)
    _add_command(bench, "serve", "served benchmark: each mode's SGLang server under load (tok/s, TPOT, TPF)", serve)
    from selfspec.images import bench as rollout

    _add_command(bench, "rollout", "image rollouts: cached AR, Batch-Synchronous SJD, HB-SJD Full / Compact / Hybrid",
                 rollout)

    from selfspec.tuning import command as tune

    _add_command(sub, "tune", "measure this machine's cost model and write a per-batch-size width plan", tune)
    from selfspec.images import gamma

    _add_command(sub, "calibrate-gamma", "measure where Hybrid image rollouts switch from Full to Compact (γ)", gamma)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv, extra = split_passthrough(list(sys.argv[1:] if argv is None else argv))
    parser = build_parser()
    args = parser.parse_args(argv)
    if extra and not getattr(args, "takes_extra", False):
        parser.error("arguments after `--` are only accepted by `selfspec serve`")
    try:
        if getattr(args, "takes_extra", False):
            return args.func(args, extra)
        return args.func(args)
    except UserError as e:
        # Problems the user can fix get one line, not a traceback: an unknown model, a mode
        # the model cannot run (ISD without a [MASK] token), a port in use, a missing SGLang,
        # a bad flag, data path or selfspec.json.
        print(f"selfspec: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
