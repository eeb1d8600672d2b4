"""memfit: pretrain, fine-tune and sample open decoder models (Llama, Mistral, Qwen2/2.5, Qwen3, Gemma 2/3, Phi-3,
and the mixtures of experts Qwen3-MoE, Mixtral and OLMoE) in the least memory.

Verbs: prepare, pretrain, finetune, estimate, plan, generate, export. Examples::

    memfit prepare --out data/mix --source-tree corpus/ --tokenizer path/to/Llama-3.2-1B   # raw text -> tokens

    memfit pretrain                                   # the main job: Tiny Shakespeare, shipped in the package
    memfit pretrain --config configs/shakespeare_char.yaml max_steps=200 optimizer.lr=3e-4
    memfit pretrain nproc=2 max_steps=200             # 2 ranks on this machine, sharded (runs torchrun)
    memfit generate --checkpoint out/shakespeare --prompt "ROMEO:" --max-new-tokens 200
    memfit finetune --config configs/finetune_lora.yaml checkpoint_dir=path/to/Llama-3.2-1B data.path=data.json
    memfit finetune checkpoint_dir=Qwen/Qwen3-0.6B method=lora data.path=data.json   # a Hub id: fetched, cached
    memfit export --checkpoint out/finetune --out path/to/hf_dir   # a directory transformers loads
    memfit estimate model=llama3-8b dtype=bf16 seq_len=2048 device=cuda   # peak memory, before allocating
    memfit estimate checkpoint_dir=Qwen/Qwen3-8B method=qlora device=cuda  # fetches config.json alone
    memfit plan model=llama3-8b budget=24GiB batch_size=1 seq_len=2048 device=cuda --out plan.yaml

Errors in the input (config keys, data files, checkpoints, output directories) are printed as one paragraph and
exit with status 2 (configuration) or 1 (everything else), before anything is allocated or overwritten.

``nproc=N`` (pretrain and finetune; not a config key) starts N ranks on this machine with torchrun and prints the
torchrun command it runs; see :mod:`memfit.launch` and docs/distributed.md for torchrun itself and multi-node runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
import sys
from pathlib import Path
from typing import Any

import yaml
from tqdm.auto import tqdm

from memfit import distributed, hub, launch, lifeline, storage, verbs
from memfit.build import check_sharding, load_for_generation, resolve_device
from memfit.config import (
    PrepareConfig,
    describe_keys,
    device_type,
    load_config,
    load_prepare_config,
    memory_budget_bytes,
    parse_overrides,
    show_progress,
)
from memfit.data.prepare import prepare, summary_table
from memfit.data.sources import source_tree
from memfit.data.tokens import MANIFEST
from memfit.errors import ConfigError, MemfitError, NoPlanError
from memfit.export import export_run
from memfit.generate import generate_text
from memfit.memory import optimizers
from memfit.planner import context, report
from memfit.planner import layout as layout_
from memfit.planner import mesh as mesh_
from memfit.planner import plan as plan_
from memfit.planner.cost import COST_CONSTANTS
from memfit.planner.estimate import estimate_run
from memfit.planner.preflight import preflight_sharded
from memfit.resume import recorded_hub
from memfit.train import train
from memfit.units import GIB, format_bytes, parse_bytes

FINETUNE_DEFAULTS = {"output_dir": "out/finetune"}
INTERRUPTED = "memfit: stopped by {}; the newest complete checkpoint is kept (resume=true continues)"


def _pretrain(args: argparse.Namespace) -> int:
    nproc, overrides = launch.split_nproc(args.overrides)
    launched = launch.launched_world_size()
    relaunch = nproc is not None and nproc > 1 and launched is None
    # validated for the ranks the run will have (here, before any worker starts, as each rank will)
    world_size = nproc if relaunch else (launched or 1)
    cfg = _load_run_config(args.verb, args.config, overrides, world_size)
    device_type = resolve_device(cfg.device).type
    if nproc is not None:
        launch.check_nproc(nproc, device_type)
    if relaunch:
        # Hub ids fetched once, here; every rank then reads the same commit from the cache
        local, sources = hub.resolve_run(cfg, recorded=recorded_hub(cfg))
        overrides = overrides + [f"{key}={source.pinned}" for key, source in sources.items()]
        cfg = local
        check_sharding(cfg, nproc)  # before any rank starts, as validation
        check = preflight_sharded(cfg, nproc)  # memory_budget: one rank traced, before any rank starts
        if check is not None:
            print(check, flush=True)
        launch.set_worker_threads(nproc, device_type)
        return launch.run_torchrun(launch.torchrun_args(nproc, args.verb, args.config, overrides))
    try:
        summary = train(cfg)
        distributed.barrier()  # every rank is done communicating before any leaves the group
    finally:
        distributed.destroy_distributed()
    if not distributed.launched_distributed() or int(os.environ.get("RANK", "0")) == 0:
        _print_summary(summary)
    return 0


def _load_run_config(verb: str, config: str | None, overrides: list[str], world_size: int):
    """The validated config of ``memfit pretrain|finetune``, for a run of ``world_size`` ranks.

    Raises:
        ConfigError: as :func:`memfit.config.load_config`; finetune without ``checkpoint_dir``.
    """
    if verb != "finetune":
        return load_config(config, overrides, world_size=world_size)
    cfg = load_config(config, overrides, defaults=FINETUNE_DEFAULTS, world_size=world_size)
    if cfg.checkpoint_dir is None:
        raise ConfigError(
            "config key 'checkpoint_dir': memfit finetune starts from pretrained weights; set "
            "checkpoint_dir=DIR (a Hugging Face, Meta or memfit checkpoint) or checkpoint_dir=ORG/NAME (a Hugging "
            "Face Hub model), or use memfit pretrain"
        )
    return cfg


def _print_summary(summary: dict) -> None:
    print()
    if summary["final_val_loss"] is None:
        # why, naming the key that decides it (RunData.val_empty_reason, passed on by train())
        print(f"final validation loss: none ({summary.get('val_empty_reason') or 'no validation samples'})")
    else:
        print(
            f"final validation loss: {summary['final_val_loss']:.4f} {summary.get('val_loss_unit', 'nats/token')}"
        )
    if summary.get("tokens_per_second_per_gpu"):
        print(f"tokens_per_second_per_gpu: {summary['tokens_per_second_per_gpu']:,.0f}")
    by_rank = summary.get("peak_memory_by_rank") or {}
    for key in ("peak_memory_rss", "peak_memory_alloc", "peak_memory_device"):
        if summary.get(key) is not None:
            print(f"{key}: {summary[key]:.3f} GiB{_fullest_rank(by_rank.get(key))}")
    print(f"checkpoint: {summary['checkpoint']}")
    if summary.get("loss_plot"):
        print(f"loss plot: {summary['loss_plot']}")
    if summary["sample"]:
        print("sample:")
        print(summary["sample"])


def _fullest_rank(values: list[float | None] | None) -> str:
    """Which rank of a sharded run reached a peak (the lowest such rank on a tie), and the lowest rank's peak:
    `` (rank 1; lowest 2.589 GiB, rank 0)``; `` (every rank)`` when all are equal; ``""`` for one process."""
    ranks = {r: v for r, v in enumerate(values or []) if v is not None}
    if len(ranks) < 2:
        return ""
    fullest, emptiest = max(ranks, key=ranks.get), min(ranks, key=ranks.get)
    if ranks[fullest] == ranks[emptiest]:
        return " (every rank)"
    return f" (rank {fullest}; lowest {ranks[emptiest]:.3f} GiB, rank {emptiest})"


def _check_option(option: str, value: Any, ok: bool, allowed: str) -> None:
    """Refuse a command-line option's value as a config key's is refused: a :class:`ConfigError` (exit status 2)
    that names the option, the value given and what is allowed."""
    if not ok:
        raise ConfigError(f"{option} must be {allowed}, got {value!r}")


def _check_path(option: str, value: str | None) -> None:
    """An option that names a file or directory, when given, is not empty (``''`` would be the current one)."""
    if value is not None:
        _check_option(option, value, bool(value.strip()), "a path, not empty")


def _estimate(args: argparse.Namespace) -> int:
    _check_path("--config", args.config)
    world_size, overrides = launch.split_count(
        args.overrides, "world_size", "the number of ranks of the sharded run"
    )
    world_size = world_size or 1
    cfg, source = _config_alone(
        load_config(args.config, overrides, world_size=world_size, needs_weights=False)
    )
    estimate = estimate_run(cfg, world_size=world_size, compose=False if args.full_trace else None)
    if source is not None:  # the report names the Hub id, not the cache's snapshot
        estimate.config["model"] = f"{source.label()} (commit {source.commit[:12]})"
    print(json.dumps(estimate.to_json()) if args.json else report.format_estimate(estimate))
    if args.explain and not args.json:  # --json has it all in "trace"
        print(report.explain_estimate(estimate))
    return 0


def _config_alone(cfg: Any) -> tuple[Any, hub.HubSource | None]:
    """``memfit estimate`` / ``plan``'s config with a Hub ``checkpoint_dir`` resolved to its snapshot in the cache,
    fetching ``config.json`` (and the shards' index) alone, never a weight; the note of where it came from goes
    to stderr (stdout stays the report, or the one JSON object of ``--json``)."""
    cfg, sources = hub.resolve_run(cfg, weights=False, data=False)
    source = sources.get("checkpoint_dir")
    if source is not None:
        print(f"checkpoint_dir: {source.describe()} (config alone)", file=sys.stderr, flush=True)
    return cfg, source


def split_budget(overrides: list[str], key: str = "budget") -> tuple[int | None, list[str]]:
    """Take ``budget=SIZE`` (not a config key) out of the CLI's ``key=value`` overrides; the last one wins.

    Returns:
        ``(bytes or None when absent, the other overrides in their order)``.

    Raises:
        ConfigError: naming ``budget``, when a value is not a size with a unit (see
            :func:`memfit.units.parse_bytes`).
    """
    budget, rest = None, []
    for item in overrides:
        name, sep, value = item.partition("=")
        if sep and name.strip() == key:
            budget = parse_bytes(value.strip(), key)
        else:
            rest.append(item)
    return budget, rest


def _plan(args: argparse.Namespace) -> int:
    _check_path("--config", args.config)
    _check_path("--out", args.out)
    _check_option("--top", args.top, args.top >= 1, ">= 1 (rows of the table)")
    _check_option("--fits", args.fits, args.fits >= 1, ">= 1 (fitting combinations to establish)")
    _check_option("--margin", args.margin, 0 <= args.margin < 1, "in [0, 1) (a fraction of the budget)")
    world_size, overrides = launch.split_count(
        args.overrides, "world_size", "the number of ranks of the sharded run"
    )
    world_size = world_size or 1
    nodes, overrides = launch.split_count(overrides, "nodes", "the number of machines")
    gpus_per_node, overrides = launch.split_count(
        overrides, "gpus_per_node", "the number of GPUs (ranks) per machine"
    )
    mesh = nodes is not None or gpus_per_node is not None
    if mesh:
        world_size = _mesh_world(nodes, gpus_per_node, world_size, args.overrides)
    budget, overrides = split_budget(overrides)
    longest = "seq_len=max" in [o.replace(" ", "") for o in overrides]
    if mesh and longest:
        raise ConfigError(
            "config key 'seq_len': seq_len=max searches one mesh; with nodes= and gpus_per_node= give a length "
            "(seq_len=8192), or plan seq_len=max with world_size=N alone"
        )
    overrides = [o for o in overrides if o.replace(" ", "") != "seq_len=max"]
    cfg, source = _config_alone(
        load_config(args.config, overrides, world_size=world_size, needs_weights=False)
    )
    spec = None if source is None else _given_checkpoint(args.config, overrides)
    budget = budget if budget is not None else memory_budget_bytes(cfg)  # budget= wins over the config's
    if budget is None:
        raise ConfigError(
            "config key 'budget': memfit plan needs the memory of one device, e.g. budget=24GiB (GiB = 1024**3 "
            "bytes) or budget=24GB (GB = 10**9 bytes), or a config with memory_budget"
        )
    dtypes = None if _sets_key(args.config, overrides, "dtype") else plan_.default_dtypes(cfg)
    # a bar of the estimates run (after a second, on a terminal); the search's lines print above it
    bar = tqdm(
        desc="memfit plan", bar_format="{desc}: {n} estimates, {elapsed}", file=sys.stderr, delay=1.0, leave=False,
        disable=args.json or not show_progress(None),
    )  # fmt: skip
    progress = None if args.json else (lambda line: tqdm.write(line, file=sys.stderr))
    if progress:
        progress(
            f"memfit plan: {cfg.model_source}, budget {format_bytes(budget)}, world_size {world_size}"
            + (", seq_len=max: the longest context that fits" if longest else "")
        )
    constants = None
    if args.interconnect_gbps is not None:
        _check_option("--interconnect-gbps", args.interconnect_gbps, args.interconnect_gbps > 0, "> 0 (GB/s)")
        constants = {
            **COST_CONSTANTS[device_type(cfg.device)],
            "interconnect_bytes_per_second": args.interconnect_gbps * 1e9,
        }
    allowed = None
    unset = args.optimizers is None and not _sets_key(args.config, overrides, "optimizer.name")
    if (
        unset
    ):  # an optimizer the user named is kept; one left unset is the plan's to choose, among every entry
        allowed = optimizers.OPTIMIZER_NAMES
    if args.optimizers is not None:
        allowed = tuple(name.strip() for name in args.optimizers.split(",") if name.strip())
        unknown = [name for name in allowed if name not in optimizers.OPTIMIZER_NAMES]
        _check_option(
            "--optimizers",
            args.optimizers,
            bool(allowed) and not unknown,
            f"a comma-separated list of optimizer.name values ({', '.join(optimizers.OPTIMIZER_NAMES)})",
        )
    request = plan_.PlanRequest(
        cfg,
        budget,
        world_size,
        margin=args.margin,
        dtypes=dtypes,
        fits=args.fits,
        progress=progress,
        constants=constants,
        optimizers=allowed,
        optimizer_unset=unset,
        estimator=_counted(estimate_run, bar),
    )
    if mesh:
        try:
            return _plan_mesh(args, request, nodes or 1, gpus_per_node, spec)
        finally:
            bar.close()
    try:
        found, result = _search(request, longest)
    finally:
        bar.close()
    best = result.best
    if args.json:
        out = found.to_json() if longest else result.to_json()
        print(json.dumps({**out, "out": args.out if best and args.out else None}))
    else:
        if args.explain:
            print(report.format_constants(result.target))
            print()
        print(
            context.format_context(found, top=args.top)
            if longest
            else report.format_plan(result, top=args.top)
        )
        if args.explain:
            made = found.made if longest else [r.estimate for r in result.rows if r.estimate is not None]
            print()
            print(report.format_how_estimated(report.how_estimated(made, found.asked if longest else None)))
    if best is None:
        raise NoPlanError(report.no_fit_message(result))
    if args.out:
        if spec is not None:  # the plan runs from the Hub id as given (fetched then), not the snapshot
            best = dataclasses.replace(best, config=dataclasses.replace(best.config, checkpoint_dir=spec))
        path = report.write_plan_yaml(args.out, best, result)
        if not args.json:
            print(
                f"wrote {path}: memfit {report.run_verb(best.config)} --config {path}"
                + (f" nproc={world_size}" if world_size > 1 else "")
            )
    return 0


def _mesh_world(nodes: int | None, gpus_per_node: int | None, world_size: int, overrides: list[str]) -> int:
    """The ranks of ``nodes=N gpus_per_node=G`` (N defaults to 1; G is required), checked against a
    ``world_size`` also given.

    Raises:
        ConfigError: ``gpus_per_node`` missing, or a ``world_size`` other than ``N x G``.
    """
    if gpus_per_node is None:
        raise ConfigError(
            f"config key 'gpus_per_node': nodes={nodes} needs the GPUs (ranks) of each machine too, e.g. "
            f"nodes={nodes} gpus_per_node=8"
        )
    world = (nodes or 1) * gpus_per_node
    given = any(o.partition("=")[0].strip() == "world_size" for o in overrides)
    if given and world_size != world:
        raise ConfigError(
            f"config key 'world_size': {world_size} is not nodes x gpus_per_node = {world}; drop world_size "
            "(the mesh's ranks are nodes x gpus_per_node)"
        )
    return world


def _plan_mesh(
    args: argparse.Namespace, request: plan_.PlanRequest, nodes: int, gpus_per_node: int, spec: Any
) -> int:
    """``memfit plan nodes=N gpus_per_node=G``: the layouts' table, the best layout's plan, its config
    (``--out``) and the torchrun line for every node."""
    result = mesh_.plan_mesh(request, nodes, gpus_per_node)
    chosen = result.best
    command = None
    if chosen is not None:
        config = args.out or "PLAN.yaml"
        command = layout_.torchrun_line(chosen.layout, report.run_verb(chosen.best.config), config)
    if args.json:
        out = {**result.to_json(), "torchrun": command, "out": args.out if chosen and args.out else None}
        print(json.dumps(out))
    else:
        print(mesh_.format_mesh_plan(result))
        if chosen is not None:
            print()
            print(f"best layout: {chosen.layout.label()}")
            print(report.format_plan(chosen.plan, top=args.top))
    if chosen is None:
        raise NoPlanError(
            f"memfit plan: nothing fits the budget on any layout of {nodes} x {gpus_per_node} GPUs (the table "
            "above says why for each); raise the budget, add nodes, or lower batch_size or seq_len"
        )
    if args.out:
        best = chosen.best
        if spec is not None:  # the plan runs from the Hub id as given (fetched then), not the snapshot
            best = dataclasses.replace(best, config=dataclasses.replace(best.config, checkpoint_dir=spec))
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(report.plan_yaml(best, chosen.plan, command), encoding="utf-8")
        if not args.json:
            print(f"wrote {path}; on every node run:\n{command}")
    elif not args.json:
        print(f"on every node run (after --out {'PLAN.yaml'}):\n{command}")
    return 0


def _search(request: plan_.PlanRequest, longest: bool) -> tuple[context.ContextPlan | None, plan_.Plan]:
    """The plan (``seq_len=max``: the longest context's search, and its plan).

    Raises:
        NoPlanError: ``seq_len=max`` and nothing fits at any length.
    """
    if not longest:
        return None, plan_.plan(request)
    found = context.longest_context(request)
    if found.plan is None:
        raise NoPlanError(
            "memfit plan: nothing fits the budget at any sequence length, not even "
            f"{context.FINE_GRANULARITY} tokens with every memory switch on; raise the budget, use more ranks "
            "(world_size) or a smaller batch_size"
        )
    return found, found.plan


def _counted(estimator: Any, bar: Any) -> Any:
    """``estimator``, advancing the progress ``bar`` by one after each estimate it makes."""

    def estimate(cfg: Any, **kwargs: Any) -> Any:
        try:
            return estimator(cfg, **kwargs)
        finally:
            bar.update()

    return estimate


def _given_checkpoint(config: str | None, overrides: list[str]) -> str | None:
    """``checkpoint_dir`` as the config file and the overrides give it (the last one wins)."""
    given = parse_overrides(overrides).get("checkpoint_dir")
    if given is None and config is not None:
        with open(config, encoding="utf-8") as f:
            given = (yaml.safe_load(f) or {}).get("checkpoint_dir")
    return None if given is None else str(given)


def _sets_key(config: str | None, overrides: list[str], key: str) -> bool:
    """Whether the config file or the overrides give ``key`` (dotted: ``optimizer.name``) a value."""

    def has(tree: Any) -> bool:
        for part in key.split("."):
            if not isinstance(tree, dict) or part not in tree:
                return False
            tree = tree[part]
        return True

    if has(parse_overrides(overrides)):
        return True
    if config is None:
        return False
    with open(config, encoding="utf-8") as f:
        return has(yaml.safe_load(f))


def _prepare(args: argparse.Namespace) -> int:
    _check_path("--out", args.out)
    _check_path("--tokenizer", args.tokenizer)
    _check_path("--source-tree", args.source_tree)
    if args.workers is not None:
        _check_option("--workers", args.workers, args.workers >= 1, ">= 1 (leave it out for one per core)")
    sources: dict[str, list[str]] = {}
    for item in args.source:
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ConfigError(
                f"--source {item!r} is not NAME=PATH_OR_GLOB (e.g. --source web='data/cc/*.jsonl.zst')"
            )
        sources.setdefault(name.strip(), []).extend(_hub_source(name.strip(), path.strip()))
    if args.source_tree is not None:
        for name, paths in source_tree(args.source_tree).items():
            if name in sources:
                raise ConfigError(
                    f"--source-tree '{args.source_tree}' has a source {name!r} that --source gives too"
                )
            sources[name] = paths
    if not sources:
        raise ConfigError(
            "memfit prepare needs at least one --source NAME=PATH_OR_GLOB or a --source-tree DIR"
        )
    cfg = load_prepare_config(args.overrides, out=args.out, tokenizer=args.tokenizer, workers=args.workers)
    progress = None  # auto: a bar when stderr is a terminal
    if args.progress or args.quiet:
        progress = args.progress
    result = prepare(cfg, sources, progress_bar=show_progress(progress))
    if result.manifest is None:
        print(
            f"prepared {result.prepared} of this node's {result.units} files into '{result.out}'; the manifest is "
            f"written when every node's files are done (run the same command again on any node to finish it)"
        )
        return 0
    print(summary_table(result.manifest))
    done = "prepared" if result.prepared else "already prepared (nothing to do)"
    print(f"{done}: {result.out / MANIFEST} ({result.seconds:.1f} s)")
    return 0


def _hub_source(name: str, spec: str) -> list[str]:
    """The files of ``--source NAME=SPEC``: ``SPEC`` itself (a path or glob), or where it reads
    ``ORG/NAME[@REVISION][:PATTERN]`` and no such local path exists, the Hub dataset's ``.parquet`` / ``.jsonl`` /
    ``.txt`` files (those ``PATTERN`` selects: fnmatch over the repo's paths), fetched into huggingface_hub's cache.

    Raises:
        DataError: see :func:`memfit.hub.resolve_dataset`.
    """
    repo, colon, pattern = spec.partition(":")
    if hub.hub_id(spec) is None and (not colon or hub.hub_id(repo) is None or Path(spec).exists()):
        return [spec]
    source = hub.resolve_dataset(
        repo, patterns=pattern or None, suffixes=hub.TEXT_SUFFIXES, key=f"--source {name}"
    )
    print(f"--source {name}: {source.describe()}, {len(source.files)} file(s)", file=sys.stderr, flush=True)
    return [str(source.path / f) for f in source.files]


def _checkpoint_path(option: str, spec: str) -> str:
    """``--checkpoint``'s directory: itself, or a Hub model's snapshot (fetched where missing)."""
    if hub.hub_id(spec) is None:
        return spec
    source = hub.resolve_checkpoint(spec, key=option)
    print(f"{option}: {source.describe()}", file=sys.stderr, flush=True)
    return str(source.path)


def _generate(args: argparse.Namespace) -> int:
    _check_path("--checkpoint", args.checkpoint)
    _check_option("--max-new-tokens", args.max_new_tokens, args.max_new_tokens >= 0, ">= 0")
    temperature = args.temperature
    _check_option(
        "--temperature", temperature, math.isfinite(temperature) and temperature >= 0, ">= 0 (0: greedy)"
    )
    _check_option("--top-k", args.top_k, args.top_k >= 0, ">= 0 (0: no top-k restriction)")
    _check_option("--seed", args.seed, 0 <= args.seed < 2**64, "in [0, 2**64)")
    device = resolve_device(args.device)
    model, tokenizer, run_template = load_for_generation(
        _checkpoint_path("--checkpoint", args.checkpoint), device=device
    )
    template = {"auto": run_template, "none": None}.get(args.template, args.template)
    if template is not None and not isinstance(template, str):
        template.check(tokenizer)  # a checkpoint's own template: refused before sampling, naming its file
    text = generate_text(
        model,
        tokenizer,
        args.prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
        template=template,
    )
    if args.json:
        shown = template if template is None or isinstance(template, str) else template.path
        print(json.dumps({"prompt": args.prompt, "template": shown, "text": text}))
    else:
        print(text)
    return 0


def _export(args: argparse.Namespace) -> int:
    _check_path("--checkpoint", args.checkpoint)
    _check_path("--out", args.out)
    size = args.max_shard_size
    _check_option(
        "--max-shard-size", size, math.isfinite(size) and size * GIB >= 1, "> 0 (GiB per safetensors file)"
    )
    exported = export_run(
        _checkpoint_path("--checkpoint", args.checkpoint),
        args.out,
        adapter_only=args.adapter_only,
        dtype=args.dtype,
        max_shard_size=int(size * GIB),
    )
    print(f"exported to {exported.path} (chat template: {exported.chat_template})")
    return 0


def _config_verb(
    sub: Any, name: str, func: Any, config_help: str, overrides_help: str, **kwargs: Any
) -> argparse.ArgumentParser:
    """A verb that takes a run config: ``--config FILE`` and ``key=value`` overrides (``kwargs``: help, description,
    epilog of the sub-parser)."""
    parser = sub.add_parser(name, formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)
    parser.add_argument("--config", default=None, help=config_help)
    parser.add_argument("overrides", nargs="*", metavar="key=value", help=overrides_help)
    parser.set_defaults(func=func)
    return parser


def _keys_epilog(title: str = "keys and defaults", keys: list[str] | None = None) -> str:
    """A verb's epilog: its ``key=value`` settings and their defaults (default: :class:`TrainConfig`'s)."""
    return f"{title}:\n  " + "\n  ".join(describe_keys() if keys is None else keys)


def build_parser() -> argparse.ArgumentParser:
    """The ``memfit`` parser: one sub-parser per verb, in the order ``memfit --help`` lists them."""
    parser, sub = verbs.top_parser()
    for add in (
        _add_pretrain,
        _add_finetune,
        _add_estimate,
        _add_plan,
        _add_prepare,
        _add_generate,
        _add_export,
    ):
        add(sub)
    return parser


def _add_pretrain(sub: Any) -> None:
    """``memfit pretrain``."""
    _config_verb(
        sub,
        "pretrain",
        _pretrain,
        "YAML preset, e.g. configs/shakespeare.yaml (default: none, the built-in defaults below)",
        "dotted overrides, e.g. max_steps=100; nproc=N ranks (default: 1, no torchrun)",
        help=verbs.VERBS["pretrain"],
        description="Pretrain a model on a text corpus: a preset of any family (model=..., e.g. qwen3-0.6b, "
        "gemma-3-1b, olmoe-1b-7b; default: shakespeare, a 5.2M-parameter Llama). Keys are "
        "memfit.config.TrainConfig fields; override any with dotted key=value (optimizer.lr=3e-4). nproc=N starts "
        "N sharded ranks on this machine (torchrun --standalone --nproc_per_node N -m memfit pretrain ...).",
        epilog=_keys_epilog("keys and defaults (the defaults are the main job)"),
    )


def _add_finetune(sub: Any) -> None:
    """``memfit finetune``: the keys of pretrain."""
    _config_verb(
        sub,
        "finetune",
        _pretrain,
        "YAML preset, e.g. configs/finetune_lora.yaml (default: none, the built-in defaults below)",
        "e.g. checkpoint_dir=DIR (or a Hub id ORG/NAME[@REVISION]) method=lora (checkpoint_dir is required); "
        "nproc=N ranks (default: 1)",
        help=verbs.VERBS["finetune"],
        description="Fine-tune a Hugging Face, Meta or memfit checkpoint (checkpoint_dir) with method full, lora, "
        "qlora or adapter, on instruction / chat records (data.format alpaca, dolly, sharegpt, openai; data.template "
        "auto = the checkpoint's own chat template, else alpaca; or alpaca, llama2-chat, llama3-chat, chatml) or a "
        "text corpus. The same keys as pretrain; output_dir "
        "defaults to out/finetune. nproc=N starts N sharded ranks on this machine (through torchrun).",
        epilog=_keys_epilog(),
    )


def _add_estimate(sub: Any) -> None:
    """``memfit estimate``."""
    est = _config_verb(
        sub,
        "estimate",
        _estimate,
        "YAML preset, e.g. configs/llama3_8b_full_single_device.yaml (default: none, the built-in defaults)",
        "e.g. model=llama3-8b world_size=8 (world_size default: 1)",
        help=verbs.VERBS["estimate"],
        description="Predict the peak memory of one rank of a run (the same config and overrides as pretrain / "
        "finetune) by running its training step on fake tensors: peak in GiB, its breakdown by category and "
        "phase, what the allocator cannot see (paged, offloaded), and the closed-form model states beside the "
        "traced ones. world_size=N estimates one rank of an N-rank FSDP2 run. device=cuda estimates a GPU run "
        "(on any machine).",
        epilog=_keys_epilog(),
    )
    est.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (peak_memory_gib, breakdown, ...) (default: the text report)",
    )
    est.add_argument(
        "--full-trace",
        action="store_true",
        help="trace every decoder layer instead of composing them from traces of 3 and 4 (the same bytes where "
        "composing holds; slower) (default: compose models of 8 layers or more where it holds)",
    )
    est.add_argument(
        "--explain",
        action="store_true",
        help="also say how the figure was obtained: the depths traced, what was composed, each trace's seconds "
        "(default: one line of it)",
    )


def _add_plan(sub: Any) -> None:
    """``memfit plan``."""
    pl = _config_verb(
        sub,
        "plan",
        _plan,
        "YAML preset to plan from (its keys are kept) (default: none, the built-in defaults)",
        "budget=24GiB (required), model=llama3-8b, world_size=N (default: 1), nodes=N gpus_per_node=G (default: "
        "none: one mesh of world_size ranks), batch_size=B, seq_len=T or "
        "seq_len=max (the longest context that fits), ...",
        help=verbs.VERBS["plan"],
        description="Enumerate combinations of the memory switches (dtype, optimizer, optimizer in backward, "
        "activation checkpointing, chunked cross-entropy, offloading; sharded: FSDP resharding and CPU offload), "
        "estimate their peak memory on fake tensors (as memfit estimate), rank those that fit budget=SIZE on each "
        "device by a throughput cost model (docs/memory.md, Planner) and write the fastest as a runnable YAML. "
        "budget is required: 24GiB (GiB = 1024**3 bytes; also MiB, TiB) or 24GB (GB = 10**9 bytes; also MB, TB). "
        "world_size=N plans one rank of an N-rank FSDP2 run; nodes=N gpus_per_node=G plans the mesh of N x G GPUs "
        "too (replicas across nodes, shards, tensor-parallel groups inside a node), writing the torchrun line for "
        "every node. dtype: kept when given, else bf16_mixed and bf16 "
        "(on CPU also fp32) are considered. device=cuda plans a GPU run on any machine. seq_len=max searches the "
        "sequence length too: the longest context each switch set allows (each adding one technique), and the "
        "fastest switch set at the longest.",
        epilog=_keys_epilog(),
    )
    pl.add_argument(
        "--out",
        default=None,
        help="write the best plan here as a config for memfit pretrain (default: none, the table only)",
    )
    pl.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (rows, best, constants) (default: the table)",
    )
    pl.add_argument("--top", type=int, default=10, help="rows of the table to print (default: 10)")
    pl.add_argument(
        "--fits",
        type=int,
        default=1,
        help="fastest fitting combinations to establish (more: more estimates) (default: 1)",
    )
    pl.add_argument(
        "--margin",
        type=float,
        default=plan_.DEFAULT_MARGIN,
        help="part of the budget kept free for what the trace does not see (fragmentation, CUDA context) "
        f"(default: {plan_.DEFAULT_MARGIN:g})",
    )
    pl.add_argument(
        "--explain",
        action="store_true",
        help="also print the cost model's constants and how the estimates were obtained (composed, traced whole, "
        "answered from memory) (default: not printed)",
    )
    pl.add_argument(
        "--optimizers",
        default=None,
        metavar="NAME,NAME,...",
        help="optimizer.name values the plan may choose, other update rules included (muon, adafactor, apollo, "
        "apollo_mini, adam_mini change the update and so the losses) (default: with optimizer.name set, it and "
        "the 8-bit and paged ones that keep its update rule; left unset, every optimizer of the registry)",
    )
    pl.add_argument(
        "--interconnect-gbps",
        type=float,
        default=None,
        help="GB/s (10**9 bytes) per rank between ranks, for FSDP's collectives and sequence parallelism's "
        "all-to-alls (default: 200, an NVLink node; InfiniBand between nodes is ~50)",
    )


def _add_prepare(sub: Any) -> None:
    """``memfit prepare``."""
    pr = sub.add_parser(
        "prepare",
        help=verbs.VERBS["prepare"],
        description="Tokenize text sources into a token dataset that runs train on (data.path=DIR): shards of "
        "uint16/uint32 ids per source with BOS/EOS between documents, validation documents held out by a hash of "
        "their text, and DIR/manifest.json. Streams its inputs (memory bounded by a few batches), uses every core, "
        "resumes after being killed, and is a no-op when run again on the same inputs. See docs/data.md.",
        epilog=_keys_epilog("key=value settings and defaults", describe_keys(PrepareConfig)[3:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    pr.add_argument("--out", required=True, help="the dataset directory to write (required)")
    pr.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer file or Hugging Face / memfit checkpoint directory (default: train a byte-level BPE)",
    )
    pr.add_argument(
        "--source",
        action="append",
        default=[],
        metavar="NAME=PATH_OR_GLOB",
        help="a source (repeatable; at least one --source or a --source-tree): a path, directory or glob, or a "
        "Hugging Face Hub dataset ORG/NAME[@REVISION][:PATTERN] (its .parquet / .jsonl / .txt files, those "
        "PATTERN selects) (default: none)",
    )
    pr.add_argument(
        "--source-tree",
        default=None,
        metavar="DIR",
        help="one source per sub-directory of DIR (default: none)",
    )
    pr.add_argument(
        "--workers",
        type=int,
        default=None,
        help="worker processes, >= 1 (default: one per CPU core it may use)",
    )
    bar = pr.add_mutually_exclusive_group()
    bar.add_argument(
        "--progress",
        action="store_true",
        help="show the progress bar (default: only when stderr is a terminal)",
    )
    bar.add_argument(
        "--quiet", action="store_true", help="no progress bar (default: only when stderr is a terminal)"
    )
    pr.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="settings below, e.g. val_fraction=0.01 num_nodes=2 node_rank=0 (default: as listed below)",
    )
    pr.set_defaults(func=_prepare)


def _add_generate(sub: Any) -> None:
    """``memfit generate``."""
    g = sub.add_parser("generate", help=verbs.VERBS["generate"], description="Sample text from a checkpoint.")
    g.add_argument(
        "--checkpoint",
        required=True,
        help="a run's output_dir (newest checkpoint), a checkpoint dir, a Hugging Face / Meta directory, or a "
        "Hugging Face Hub model ORG/NAME[@REVISION] (required)",
    )
    g.add_argument(
        "--prompt",
        default="",
        help="text to continue, read as a training document starts (BOS first where the tokenizer puts one) "
        "(default: empty)",
    )
    g.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate, >= 0 (default: 200)")
    g.add_argument(
        "--temperature", type=float, default=0.8, help="softmax temperature; 0 = greedy (default: 0.8)"
    )
    g.add_argument(
        "--top-k", type=int, default=50, help="sample among the k most likely; 0 = all (default: 50)"
    )
    g.add_argument("--seed", type=int, default=0, help="seed of the sampling, in [0, 2**64) (default: 0)")
    g.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="auto: CUDA when available, else CPU (default: auto)",
    )
    g.add_argument(
        "--template",
        default="auto",
        choices=["auto", "none", "alpaca", "llama2-chat", "llama3-chat", "chatml"],
        help="prompt template: auto = the one the run fine-tuned with (none for pretraining runs), or a Hugging "
        "Face checkpoint's own chat template (chat_template.jinja or tokenizer_config.json; none where it has "
        "none); the prompt is then the user's message and only the reply is printed (default: auto)",
    )
    g.add_argument(
        "--json", action="store_true", help="print {prompt, template, text} as JSON (default: the text only)"
    )
    g.set_defaults(func=_generate)


def _add_export(sub: Any) -> None:
    """``memfit export``."""
    e = sub.add_parser(
        "export",
        help=verbs.VERBS["export"],
        description="Export a memfit run or checkpoint (or convert a Meta checkpoint) to a Hugging Face "
        "directory of its family's own class (LlamaForCausalLM, Qwen3ForCausalLM, Gemma2ForCausalLM, ...). LoRA "
        "runs are merged into the base weights, or with --adapter-only written in PEFT's adapter format. The "
        "directory's chat template is the one the run trained with (a built-in data.template as Jinja, in place "
        "of the checkpoint's own); the last line says which.",
    )
    e.add_argument(
        "--checkpoint",
        required=True,
        help="memfit run or checkpoint dir, a Meta/HF directory, or a Hub model ORG/NAME[@REVISION] (required)",
    )
    e.add_argument(
        "--out", required=True, help="new directory to write; must not exist or be empty (required)"
    )
    e.add_argument(
        "--adapter-only",
        action="store_true",
        help="LoRA runs: write only the adapter, in PEFT's format (default: the merged model)",
    )
    e.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "fp32", "bf16"],
        help="dtype of the written weights; auto keeps the weights' dtype (default: auto)",
    )
    e.add_argument(
        "--max-shard-size", type=float, default=5.0, help="GiB per safetensors file, > 0 (default: 5)"
    )
    e.set_defaults(func=_export)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``memfit`` command. Returns the process exit status."""
    args = build_parser().parse_args(argv)
    previous = signal.signal(signal.SIGTERM, _terminated)  # SIGTERM stops a run as Ctrl-C does
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"memfit: config error: {exc}", file=sys.stderr)
        return 2
    except MemfitError as exc:  # every error memfit reports as a message (TokenizerError included)
        if not exc.every_rank or os.environ.get("RANK", "0") == "0":
            print(f"memfit: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        signum = getattr(exc, "signum", signal.SIGINT)
        if os.environ.get("RANK", "0") == "0":  # under torchrun every rank is interrupted: one says so
            print(INTERRUPTED.format(signal.Signals(signum).name), file=sys.stderr)
        return 128 + signum
    except OSError as exc:  # a file error no message above covers: still a paragraph, not a traceback
        error = storage.os_error_of(exc)
        where = f" '{exc.filename}'" if exc.filename else ""
        print(f"memfit: error: {storage.cause(error)}{where}; nothing further was written", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
        # a worker whose launcher died says so however it ends: the kernel's SIGTERM may end the run before the
        # watch thread's next poll
        lifeline.report_launcher_gone()


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill``, a scheduler's stop): raised where the run is, like Ctrl-C's ``KeyboardInterrupt``, so
    that it unwinds the same way (a checkpoint being written is completed first; the newest complete one is
    kept)."""

    signum = signal.SIGTERM


def _terminated(signum: int, frame: Any) -> None:
    # once: the run is stopping already, and a second SIGTERM (a launcher's, then the kernel's when that launcher
    # dies, memfit/lifeline.py) must not break off its clean-up
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Terminated()


if __name__ == "__main__":
    raise SystemExit(main())
