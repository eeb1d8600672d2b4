"""memfit: pretrain and sample Llama models in the least memory (verbs: pretrain, generate).

Examples::

    memfit pretrain                                   # the main job: Tiny Shakespeare, shipped in the package
    memfit pretrain --config configs/shakespeare_char.yaml max_steps=200 optimizer.lr=3e-4
    memfit generate --checkpoint out/shakespeare --prompt "ROMEO:" --max-new-tokens 200

Errors in the input (config keys, data files, checkpoints, output directories) are printed as one paragraph and
exit with status 2 (configuration) or 1 (everything else), before anything is allocated or overwritten.
"""

from __future__ import annotations

import argparse
import json
import sys

from memfit.errors import ConfigError, MemfitError


def _pretrain(args: argparse.Namespace) -> int:
    from memfit.config import load_config
    from memfit.train import train

    cfg = load_config(args.config, args.overrides)
    summary = train(cfg)
    print()
    print(f"final validation loss: {summary['final_val_loss']:.4f} nats/token")
    if summary.get("tokens_per_second_per_gpu"):
        print(f"tokens_per_second_per_gpu: {summary['tokens_per_second_per_gpu']:,.0f}")
    for key in ("peak_memory_rss", "peak_memory_alloc", "peak_memory_device"):
        if summary.get(key) is not None:
            print(f"{key}: {summary[key]:.3f} GiB")
    print(f"checkpoint: {summary['checkpoint']}")
    if summary.get("loss_plot"):
        print(f"loss plot: {summary['loss_plot']}")
    if summary["sample"]:
        print("sample:")
        print(summary["sample"])
    return 0


def _generate(args: argparse.Namespace) -> int:
    from memfit.generate import generate_text, load_for_generation
    from memfit.train import resolve_device

    device = resolve_device(args.device)
    model, tokenizer = load_for_generation(args.checkpoint, device=device)
    text = generate_text(
        model,
        tokenizer,
        args.prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
    )
    if args.json:
        print(json.dumps({"prompt": args.prompt, "text": text}))
    else:
        print(text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="memfit",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="verb", required=True)

    from memfit import __version__
    from memfit.config import describe_keys

    parser.add_argument("--version", action="version", version=f"memfit {__version__}")
    p = sub.add_parser(
        "pretrain",
        help="pretrain a Llama on a text corpus (default: Tiny Shakespeare)",
        description="Pretrain a Llama on a text corpus. Keys are memfit.config.TrainConfig fields; "
        "override any with dotted key=value (optimizer.lr=3e-4).",
        epilog="keys and defaults (the defaults are the main job):\n  " + "\n  ".join(describe_keys()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--config", default=None, help="YAML preset, e.g. configs/shakespeare.yaml (default: built-in)"
    )
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. max_steps=100")
    p.set_defaults(func=_pretrain)

    g = sub.add_parser(
        "generate",
        help="sample text from a checkpoint",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g.add_argument(
        "--checkpoint", required=True, help="a run's output_dir (newest checkpoint) or a checkpoint dir"
    )
    g.add_argument("--prompt", default="", help="text to continue (empty: start from BOS)")
    g.add_argument("--max-new-tokens", type=int, default=200)
    g.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=50, help="0 = no top-k restriction")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    g.add_argument("--json", action="store_true", help="print {prompt, text} as JSON")
    g.set_defaults(func=_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``memfit`` command. Returns the process exit status."""
    args = build_parser().parse_args(argv)
    if (
        getattr(args, "max_new_tokens", 0) < 0
        or getattr(args, "top_k", 0) < 0
        or getattr(args, "temperature", 0) < 0
    ):
        print("memfit: error: --max-new-tokens, --top-k and --temperature must be >= 0", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"memfit: config error: {exc}", file=sys.stderr)
        return 2
    except MemfitError as exc:
        print(f"memfit: error: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # TokenizerError and other input errors from libraries
        if type(exc).__name__ == "TokenizerError":
            print(f"memfit: error: {exc}", file=sys.stderr)
            return 1
        raise
    except KeyboardInterrupt:
        print(
            "memfit: interrupted; the newest complete checkpoint is kept (resume=true continues)",
            file=sys.stderr,
        )
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
