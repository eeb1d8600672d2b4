"""The ``memfit`` command's front page: its verbs and their one-line help, without importing torch.

``memfit --help`` and ``memfit --version`` are answered from here (:func:`front_page`, called by
:mod:`memfit.__main__` before anything heavier is imported: ``import torch`` alone takes over a second);
:func:`memfit.cli.build_parser` builds the full parser from the same lines, so the two pages are the same text
(tested).
"""

from __future__ import annotations

import argparse

from memfit import __version__

DESCRIPTION = (
    "memfit: pretrain, fine-tune and sample open decoder models (Llama, Mistral, Qwen2/2.5, Qwen3, Gemma 2/3, "
    "Phi-3, and the mixtures of experts Qwen3-MoE, Mixtral and OLMoE) in the least memory."
)
"""The first line of ``memfit --help``."""

VERBS: dict[str, str] = {
    "pretrain": "pretrain a model of any family's preset on a text corpus (default: a 5.2M Llama, Tiny Shakespeare)",
    "finetune": "fine-tune pretrained weights (full, LoRA, QLoRA or adapter) on instructions, chats or text",
    "estimate": "predict a run's peak memory on fake tensors, before allocating anything",
    "plan": "pick the fastest memory switches that fit a memory budget, and write them as a config",
    "prepare": "turn raw text (jsonl, jsonl.gz, jsonl.zst, parquet, txt) into a sharded token dataset, once",
    "generate": "sample text from a checkpoint",
    "export": "write a checkpoint as a Hugging Face directory (config.json + safetensors + tokenizer)",
}
"""Each verb's line in ``memfit --help``, in the order it lists them."""

FRONT_PAGE_ARGS = ("-h", "--help", "--version")
"""The first arguments the front page answers by itself."""


def top_parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    """The ``memfit`` parser without its verbs' own arguments, and the action to add the verbs to."""
    parser = argparse.ArgumentParser(
        prog="memfit", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="verb", required=True)
    parser.add_argument("--version", action="version", version=f"memfit {__version__}")
    return parser, sub


def front_page(argv: list[str]) -> bool:
    """Answer ``memfit -h`` / ``--help`` / ``--version`` (``argv[0]`` one of :data:`FRONT_PAGE_ARGS`): print the
    page and raise ``SystemExit(0)`` as argparse does. Returns False, printing nothing, for any other ``argv``.

    Raises:
        SystemExit: the page was printed.
    """
    if not argv or argv[0] not in FRONT_PAGE_ARGS:
        return False
    front_parser().parse_args(argv[:1])
    return False  # not reached: argparse exits after printing


def front_parser() -> argparse.ArgumentParser:
    """:func:`top_parser` with each verb and its line of help, and none of the verbs' own arguments."""
    parser, sub = top_parser()
    for name, line in VERBS.items():
        sub.add_parser(name, help=line)
    return parser
