"""THE training loop. Pretraining and every fine-tuning method (full, LoRA, adapter) are configurations of
:func:`train`: they differ only in where the weights start (random or ``checkpoint_dir``), which weights train
(``method``) and where batches come from (text windows or instruction samples, :class:`~memfit.data.run.RunData`).

Read top to bottom: set-up (resume state, tokenizer and data, pre-flight, model and optimizer), then the loop with
its "once in a while" blocks (log, evaluate, checkpoint), then the end (final evaluation, checkpoint, plot,
sample). The step itself is :func:`memfit.step.train_step`; the model and optimizer come from
:func:`memfit.build.build_training`, the one build sequence the estimator shares.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from memfit import checkpoint as ckpt_io
from memfit import distributed as dist_
from memfit import hub, runlock
from memfit.build import (
    build_training,
    checkpoint_model_config,
    load_for_generation,
    resolve_device,
    resolve_model_config,
    run_template,
)
from memfit.config import TrainConfig, check_lengths, config_to_dict, show_progress, with_absolute_paths
from memfit.convert import weights_fingerprint
from memfit.data.run import RunData, run_data, run_tokenizer
from memfit.errors import DivergenceError, RunLockedError
from memfit.flops import mfu_above_one, peak_flops_per_second, training_flops_per_token
from memfit.generate import generate_text
from memfit.memory import host, switches
from memfit.memory.optim import create_state, describe_partition, lr_at
from memfit.memory.stats import PeakMemory, process_peak_rss, tracked_memory_fields
from memfit.memory.timeline import plot_timeline
from memfit.memory.tracker import MemoryTracker
from memfit.metrics import MetricsLogger, Throughput, plot_losses
from memfit.models.config import DecoderConfig
from memfit.planner.disk import check_checkpoint_disk
from memfit.planner.preflight import preflight
from memfit.reference import default_reference_dir, precompute_reference, reference_key
from memfit.resume import (
    check_resume,
    check_resume_model,
    find_resume,
    recorded_hub,
    resume_notes,
    resumed_config,
)
from memfit.step import StepResult, evaluate, evaluation_options, train_step, train_step_options
from memfit.units import to_gib
from memfit.validation import reference_mode


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run pretraining or fine-tuning as ``cfg`` describes (the config must come from
    :func:`memfit.config.load_config`).

    Returns:
        A summary: ``final_val_loss``, ``steps``, ``tokens_per_second_per_gpu`` (mean over the run),
        ``peak_memory_rss`` / ``peak_memory_alloc`` / ... (GiB, whole run, the fullest rank's; sharded, with each
        rank's in ``peak_memory_by_rank``, see :func:`run_peaks`), ``checkpoint``, ``sample``, ``num_params``.

    Raises:
        ConfigError, DataError, CheckpointError: bad input, reported before anything is allocated or overwritten.
        PreflightError: the run is predicted not to fit (``preflight``).
    """
    cfg = with_absolute_paths(cfg)
    device = dist_.init_distributed(resolve_device(cfg.device))  # under torchrun: this rank's device
    with _run_lock(Path(cfg.output_dir)), contextlib.ExitStack() as cleanup:  # one run per output_dir
        # Hub ids -> the cache's snapshots (fetched now where missing; a resume reads the commit it recorded)
        say = tqdm.write if dist_.is_main() else (lambda line: None)
        cfg, sources = hub.resolve_run(cfg, recorded=recorded_hub(cfg), say=say)
        return _train(cfg, device, cleanup, sources)


def _train(
    cfg: TrainConfig, device: torch.device, cleanup: contextlib.ExitStack, sources: dict[str, hub.HubSource]
) -> dict[str, Any]:
    """:func:`train` holding the run directory's lock; ``cleanup`` closes what the run opens, however it ends;
    ``sources``: the Hub repos ``checkpoint_dir`` and ``data.path`` named (:func:`memfit.hub.resolve_run`)."""
    # --- set-up: resume state, tokenizer, data, pre-flight (all checked before any weight is allocated) -------
    run = _set_up(cfg, device, sources)
    out, main_rank = run.out, run.main_rank

    # --- model and optimizer (sharded: built on meta, each rank fills only its shards) ------------------------
    built = build_training(cfg, run.mcfg, device, world_size=run.world)
    model, optimizer = built.model, built.optimizer
    if reference_mode(cfg) == "precomputed":  # from the starting weights: before a resumed run's are loaded
        _reference_tables(cfg, run, model, device)
    start_step = 0
    if run.resume_dir is not None:
        start_step = int(ckpt_io.load_checkpoint(run.resume_dir, model, optimizer)["step"])
    verb = "pretrain" if cfg.checkpoint_dir is None else f"finetune ({cfg.method})"
    if main_rank:
        tqdm.write(_banner(cfg, verb, built, run, device, start_step))
    if device.type == "cpu":
        create_state(optimizer)  # in one piece of glibc's heap, not between the first step's temporaries
    logger = cleanup.enter_context(_metrics_logger(cfg, run, start_step))  # a failed W&B run ends as failed
    memory = cleanup.enter_context(contextlib.closing(PeakMemory(device)))
    records = _StepRecords(cfg, run, device, logger)
    # skipping a non-finite step changes no memory: the estimator traces the step without it
    step_options = {**train_step_options(cfg, built.reference), "skip_nonfinite": cfg.on_nonfinite == "skip"}
    eval_options = evaluation_options(cfg, device, built.reference)
    tracker = MemoryTracker(model, optimizer) if cfg.track_memory else None
    divergence = _Divergence(cfg, out, device, start_step)
    save = _saver(cfg, run, model, optimizer, divergence)

    # --- the loop ---------------------------------------------------------------------------------------------
    model.train()
    bar = tqdm(
        total=cfg.max_steps,
        initial=start_step,
        desc=verb.split(" ")[0],
        unit="step",
        disable=not (show_progress(cfg.progress_bar) and main_rank),
        dynamic_ncols=True,
    )
    last_ckpt = None
    for step in range(start_step, cfg.max_steps):
        t0 = time.perf_counter()
        lr = _set_lr(cfg, optimizer, step)
        micro_batches = [
            tuple(t if t is None else t.to(device, non_blocking=True) for t in run.data.train_batch(step, m))
            for m in range(cfg.gradient_accumulation_steps)
        ]
        tokens_this_step = sum(mb[0].numel() for mb in micro_batches)
        if tracker is None:
            result = train_step(model, optimizer, micro_batches, **step_options)
        else:
            # draw the run's second step (optimizer state exists by then), or its only step; rank 0 draws its own
            plot_this = main_rank and (step == start_step + 1 or step == cfg.max_steps - 1 == start_step)
            title = f"memory by category, step {step + 1} ({cfg.model})"
            plot = (out / "memory_timeline.png", title) if plot_this else None
            result = _tracked_step(tracker, model, optimizer, micro_batches, step_options, plot is not None)
            if plot is not None:
                # drawn here, not inside the step's frame: matplotlib's first import leaves a reference cycle that
                # keeps the frames below it alive until the garbage collector runs (a tracked step's batches with
                # them, which the next step's peak would then hold)
                plot_timeline(tracker.timeline, plot[0], title=plot[1])
        memory.sample()
        done = step + 1
        bar.update(1)
        divergence.observe(done, result)

        # once in a while: log (the only host sync of a training step)
        if done % cfg.log_every == 0 or done == cfg.max_steps:
            divergence.check()
            loss = records.log(done, lr, result, t0, tokens_this_step, memory, tracker)
            bar.set_postfix(loss=f"{loss:.3f}")
        else:
            records.throughput.add(time.perf_counter() - t0, tokens_this_step)

        # once in a while: evaluate
        if cfg.eval_every and done % cfg.eval_every == 0 and done != cfg.max_steps:
            divergence.check()
            val = _validate(model, run.data, eval_options)
            if not math.isnan(val["val_loss"]):  # NaN: no validation samples (data.val_fraction=0)
                logger.log({"step": done, **val})

        # once in a while: checkpoint
        if cfg.checkpoint_every and done % cfg.checkpoint_every == 0 and done != cfg.max_steps:
            last_ckpt = save(done)
    bar.close()

    # --- the end: final evaluation, checkpoint, plot, sample --------------------------------------------------
    divergence.check()
    val = _validate(model, run.data, eval_options)
    val_loss = val["val_loss"]
    if start_step < cfg.max_steps:
        if not math.isnan(val_loss):
            logger.log({"step": cfg.max_steps, **val})
        last_ckpt = save(cfg.max_steps)
    else:  # resumed a finished run: report, but add nothing to its records or checkpoints
        if main_rank:
            tqdm.write(f"the run in '{out}' is already complete at step {start_step}; nothing to train")
        last_ckpt = run.resume_dir
    logger.close()
    return _summary(cfg, run, built, model, records, val_loss, last_ckpt, device)


@dataclass
class _Run:
    """What the set-up of a run found, all checked before any weight is allocated."""

    main_rank: bool
    world: int
    """Ranks of the run."""
    out: Path
    resume_dir: Path | None
    resume_state: dict[str, Any] | None
    tokenizer: Any
    mcfg: DecoderConfig
    seq_len: int
    data: RunData
    sources: dict[str, hub.HubSource] = field(default_factory=dict)
    """The Hub repos the run reads (:func:`memfit.hub.resolve_run`), recorded in its checkpoints."""


def _set_up(cfg: TrainConfig, device: torch.device, sources: dict[str, hub.HubSource]) -> _Run:
    """Resume state, tokenizer, architecture, data and the pre-flight check; ``output_dir`` is created last, so
    that bad input leaves none behind."""
    main_rank, world = dist_.is_main(), dist_.world_size()
    out = Path(cfg.output_dir)
    resume_dir, resume_state = find_resume(cfg)
    if resume_dir is not None:
        cfg = resumed_config(cfg, resume_state)  # data.template=auto: the run's own template
        check_resume(cfg, resume_dir, resume_state)
        if main_rank:
            for note in resume_notes(cfg, resume_state, world):
                tqdm.write(note)
    start_config = checkpoint_model_config(cfg.checkpoint_dir) if cfg.checkpoint_dir is not None else None
    tokenizer, manifest = run_tokenizer(cfg, out, resume_dir)
    mcfg = start_config or resolve_model_config(cfg, tokenizer.vocab_size)
    if resume_dir is not None:  # the architecture of the run resumed, before the data, pre-flight and build
        check_resume_model(cfg, resume_dir, resume_state, mcfg)
    seq_len = check_lengths(cfg, mcfg, tokenizer.vocab_size)
    # the checkpoints' disk space, before data is prepared or anything allocated (planner/disk.py)
    if cfg.preflight:
        start = int(resume_state["step"]) if resume_state is not None else 0
        check_checkpoint_disk(cfg, mcfg, world, start, len(ckpt_io.list_checkpoints(out)))
    data = run_data(cfg, tokenizer, manifest, seq_len, out)
    host.release_free_heap()  # host memory: what preparing the data freed leaves the resident set (memory/host.py)
    if cfg.preflight:
        check = preflight(cfg, mcfg, data.longest, device)
        if main_rank:
            tqdm.write(check)
    elif cfg.memory_budget is not None and main_rank:  # preflight=false wins: nothing is checked
        tqdm.write(f"note: preflight=false: memory_budget={cfg.memory_budget} is not checked")
    threshold = host.mmap_threshold_bytes(cfg.method, cfg.dtype)
    if host.fixes_mmap_threshold(
        cfg.mmap_threshold, mcfg.dim, device.type, cfg.method, dtype=cfg.dtype
    ) and host.fix_mmap_threshold(threshold):
        if main_rank:  # before the model is built: its weights and every step's temporaries are given back
            tqdm.write(
                f"note: glibc's mmap threshold fixed at {threshold // 1024} KiB "
                f"(mmap_threshold={cfg.mmap_threshold}, dim {mcfg.dim}): freed tensors go back to the kernel"
            )
    capped = (
        host.cap_onednn_primitive_cache() if host.caps_onednn_cache(device.type, mcfg.num_experts) else []
    )
    if capped and main_rank:
        tqdm.write(
            f"note: matmul primitive caches capped ({', '.join(capped)}): a mixture of experts' matmuls take a new "
            "shape at every expert and step"
        )
    out.mkdir(parents=True, exist_ok=True)  # only now: bad input above leaves no output_dir behind
    if main_rank and cfg.optimizer.warmup_steps >= cfg.max_steps:
        tqdm.write(
            f"note: optimizer.warmup_steps ({cfg.optimizer.warmup_steps}) >= max_steps ({cfg.max_steps}): the "
            f"learning rate never reaches optimizer.lr ({cfg.optimizer.lr:g})"
        )
    return _Run(main_rank, world, out, resume_dir, resume_state, tokenizer, mcfg, seq_len, data, sources)


def _reference_tables(cfg: TrainConfig, run: _Run, model: torch.nn.Module, device: torch.device) -> None:
    """A preference run's stored reference log-probabilities (:mod:`memfit.reference`): read, or computed now by
    the starting model, for each split; handed to the run's batches."""
    pairs, pref = run.data.pairs, cfg.preference
    directory = Path(pref.reference_dir) if pref.reference_dir else default_reference_dir(cfg.data.path)
    if not pref.reference_dir and "data.path" in run.sources:  # Hub records: not beside them, in the cache
        directory = run.out / "reference"
    for label, split in (("train", pairs.train), ("val", pairs.val)):
        if not len(split):
            continue
        # rank 0 hashes the checkpoint (its per-file hashes cached beside the tables), every rank uses its key
        key = dist_.from_main(
            reference_key(cfg.checkpoint_dir, split.fingerprint(), cfg.dtype, directory / "checkpoints.json")
            if run.main_rank
            else None
        )
        stored = (directory / f"{key}.npy").is_file()
        batch_size = pref.reference_batch_size or cfg.batch_size
        if run.main_rank and not stored:
            tqdm.write(
                f"reference log-probabilities of {len(split):,} {label} pairs: computing with the starting weights "
                f"({batch_size} pair(s) a forward)"
            )
        t0 = time.perf_counter()
        run.data.references[label] = precompute_reference(
            model,
            split,
            batch_size=batch_size,
            device=device,
            directory=directory,
            key=key,
            step_options=train_step_options(cfg),
            describe={"checkpoint_dir": cfg.checkpoint_dir, "data": cfg.data.path, "dtype": cfg.dtype},
            progress_bar=show_progress(cfg.progress_bar),
            label=label,
        )
        if run.main_rank:
            how = "reused" if stored else f"computed in {time.perf_counter() - t0:.1f} s"
            tqdm.write(
                f"reference log-probabilities of {len(split):,} {label} pairs: {how}, '{directory / key}.npy'"
            )


def _metrics_logger(cfg: TrainConfig, run: _Run, start_step: int) -> MetricsLogger:
    """The run's step records (stdout, metrics.jsonl, TensorBoard, W&B), written by the main rank."""
    return MetricsLogger(
        run.out,
        tensorboard=cfg.tensorboard,
        resume_step=start_step if run.resume_dir else None,
        enabled=run.main_rank,
        wandb_project=cfg.wandb_project if cfg.wandb else None,
        wandb_run_name=cfg.wandb_run_name,
        run_config=config_to_dict(cfg),
    )


def _saver(cfg: TrainConfig, run: _Run, model, optimizer, divergence: _Divergence) -> Callable[[int], Path]:
    """``save(step)``: the run's checkpoint at ``step``, refused when the run diverged."""
    # world_size: a resume on other ranks says what became of the global batch (resume_notes)
    trainer_state = {"config": config_to_dict(cfg), "data_position": "step", "world_size": run.world}
    # the commit each Hub id resolved to: a resume reads the same (hub.resolve_run's recorded)
    if run.sources:
        trainer_state["hub"] = {key: source.record() for key, source in run.sources.items()}
    if cfg.method != "full":  # the base stays in checkpoint_dir: remember which weights it held
        trainer_state["base_fingerprint"] = weights_fingerprint(cfg.checkpoint_dir)

    def save(step: int) -> Path:
        divergence.check()
        host.release_free_heap()  # the steps' free heap back to the kernel: the save starts from the live tensors
        if run.main_rank:
            tqdm.write(f"saving checkpoint step_{step:08d} ...")
        if not dist_.all_finite(p for p in model.parameters() if p.requires_grad):
            raise DivergenceError(  # a finite loss and gradient norm, but not finite weights (an overflow)
                f"the weights are not finite at step {step} (the run diverged), so no checkpoint was written; "
                f"{ckpt_io.kept_checkpoint(run.out)}. Lower optimizer.lr or raise optimizer.warmup_steps"
            )
        return ckpt_io.save(
            run.out,
            step,
            model,
            optimizer,
            model_config=run.mcfg,
            trainer_state=trainer_state,
            tokenizer=run.tokenizer,
            keep_last=cfg.keep_last_checkpoints,
            trainable_only=cfg.method != "full",
        )

    return save


def _set_lr(cfg: TrainConfig, optimizer, step: int) -> float:
    """Set and return the learning rate of ``step`` (warm-up, then cosine decay)."""
    lr = lr_at(
        step,
        lr=cfg.optimizer.lr,
        min_lr=cfg.optimizer.min_lr,
        warmup_steps=cfg.optimizer.warmup_steps,
        max_steps=cfg.max_steps,
    )
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)  # Muon's AdamW group: optimizer.adamw_lr / optimizer.lr
    return lr


class _StepRecords:
    """The step records of a run: throughput, this rank's memory peaks over the run, MFU."""

    def __init__(self, cfg: TrainConfig, run: _Run, device: torch.device, logger: MetricsLogger) -> None:
        self.cfg, self.device, self.logger, self.main_rank = cfg, device, logger, run.main_rank
        self.throughput = Throughput()
        self.rank_peak: dict[str, float] = {}  # this rank's own peaks over the run (GiB)
        self.flops_per_token = training_flops_per_token(run.mcfg, run.seq_len, full=cfg.method == "full")
        self.peak_flops = peak_flops_per_second(device, cfg.dtype, cfg.peak_flops)
        self.mfu_warned = False

    def log(self, done: int, lr: float, result: StepResult, t0: float, tokens: int, memory, tracker) -> float:
        """Log the record of step ``done`` (the only host sync of a training step); returns its loss."""
        loss = result.loss.item()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.throughput.add(time.perf_counter() - t0, tokens)
        rate = self.throughput.interval_rate()  # this rank's
        peaks = memory.read_and_reset()  # this rank's
        self.rank_peak.update(
            {k: max(self.rank_peak.get(k, 0.0), v) for k, v in peaks.items() if v is not None}
        )
        record = {
            "step": done,
            "loss": loss,
            "lr": lr,
            "grad_norm": result.grad_norm.item(),
            **{name: value.item() for name, value in result.metrics.items()},  # a preference objective's
            "tokens_per_second_per_gpu": rate,
            "mfu": rate * self.flops_per_token / self.peak_flops if self.peak_flops else None,
            **dist_.max_over_ranks(peaks),  # the peaks of the fullest rank
        }
        if record["mfu"] is not None and record["mfu"] > 1 and not self.mfu_warned:  # once, saying why
            self.mfu_warned = True
            if self.main_rank:
                achieved = rate * self.flops_per_token
                tqdm.write(
                    mfu_above_one(
                        record["mfu"], done, achieved, self.peak_flops, self.device, self.cfg.peak_flops
                    )
                )
        if tracker is not None:  # sharded: the breakdown of the rank with the highest tracked peak
            record.update(tracked_memory_fields(tracker))
        self.logger.log(record)
        return loss


def _summary(
    cfg, run: _Run, built, model, records: _StepRecords, val_loss, last_ckpt, device
) -> dict[str, Any]:
    """The end of a run once its records are closed: the loss plot, the sample, and what :func:`train` returns."""
    plot = (
        plot_losses(run.out / "metrics.jsonl", run.out / "loss.png")
        if run.main_rank and cfg.loss_plot
        else None
    )
    sample = _sample(cfg, model, run.tokenizer, last_ckpt, device) if run.main_rank else ""
    rank_peak = records.rank_peak
    if device.type == "cpu" and process_peak_rss() is not None:  # the whole process's, as ru_maxrss says
        rank_peak["peak_memory_rss"] = to_gib(process_peak_rss())
    return {
        "final_val_loss": None if math.isnan(val_loss) else val_loss,
        "val_empty_reason": run.data.val_empty_reason,
        "val_loss_unit": "nats/token" if cfg.objective == "next_token" else f"{cfg.objective} loss per pair",
        "steps": cfg.max_steps,
        "num_params": built.num_params,
        "num_trainable_params": built.num_trainable,
        "tokens_per_second_per_gpu": records.throughput.run_rate,
        **run_peaks(rank_peak),
        "checkpoint": str(last_ckpt),
        "loss_plot": str(plot) if plot else None,
        "sample": sample,
    }


def run_peaks(rank_peak: dict[str, float]) -> dict[str, Any]:
    """The run's memory peaks: each the maximum over ranks of every rank's own peak over the run. Collective when
    sharded (every rank calls it, at the end).

    Args:
        rank_peak: this rank's peaks in GiB (``peak_memory_rss``, ``peak_memory_alloc``, ...; those it measured).

    Returns:
        ``{key: GiB}``, the fullest rank's of each key; sharded, also ``peak_memory_by_rank``: ``{key: [GiB of rank
        0, rank 1, ...]}``, so that a report can name the fullest rank.
    """
    ranks = dist_.all_gather_objects(rank_peak)
    keys = list(dict.fromkeys(k for r in ranks for k in r))
    by_rank = {k: [r.get(k) for r in ranks] for k in keys}
    peaks: dict[str, Any] = {k: max(v for v in values if v is not None) for k, values in by_rank.items()}
    if len(ranks) > 1:
        peaks["peak_memory_by_rank"] = by_rank
    return peaks


@contextlib.contextmanager
def _run_lock(out: Path) -> Iterator[None]:
    """Hold ``output_dir``'s lock (:mod:`memfit.runlock`) for the run: rank 0 takes it for every rank, and when
    another run holds it every rank raises :class:`~memfit.errors.RunLockedError`."""
    lock, error = None, None
    if dist_.is_main():
        ckpt_io.check_writable(out)
        try:
            lock = runlock.acquire(out)
        except RunLockedError as exc:
            error = str(exc)
    error = dist_.from_main(error)
    if error is not None:
        exc = RunLockedError(error)
        exc.every_rank = True  # the same error on every rank: rank 0 alone prints it
        raise exc
    if lock is not None and lock.note:
        tqdm.write(lock.note)
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


class _Divergence:
    """Finds steps whose loss or gradient norm is not finite, as ``on_nonfinite`` says.

    ``stop``: each step's values are compared on the device (no host sync); :meth:`check`, called where the loop
    syncs anyway (step records, evaluations, checkpoints, the end), raises for the first such step. ``skip``:
    :func:`~memfit.step.train_step` did not apply such a step; :meth:`observe` says so and raises after
    ``max_nonfinite_steps`` in a row.
    """

    def __init__(self, cfg: TrainConfig, out: Path, device: torch.device, start_step: int) -> None:
        self.cfg, self.out = cfg, out
        # the step count is kept on the device too: copying the host's step number over each step would sync
        self.steps = torch.full((), float(start_step), device=device)
        # (step, loss, grad_norm) of the first bad step; step 0: none yet
        self.first = torch.zeros(3, device=device)
        self.in_a_row = 0

    def observe(self, step: int, result: StepResult) -> None:
        if self.cfg.on_nonfinite == "skip":
            if not result.skipped:
                self.in_a_row = 0
                return
            self.in_a_row += 1
            loss, grad_norm = result.loss.item(), result.grad_norm.item()
            if self.in_a_row >= self.cfg.max_nonfinite_steps:
                self._raise(step, loss, grad_norm, f"{self.in_a_row} steps in a row (max_nonfinite_steps)")
            if dist_.is_main():
                tqdm.write(
                    f"step {step} | loss {loss} | grad_norm {grad_norm} | not finite: update skipped "
                    f"({self.in_a_row} in a row; the run stops at max_nonfinite_steps={self.cfg.max_nonfinite_steps})"
                )
            return
        self.steps += 1
        bad = ~(torch.isfinite(result.loss) & torch.isfinite(result.grad_norm))
        row = torch.stack((self.steps, result.loss.float(), result.grad_norm.float()))
        self.first = torch.where(bad & (self.first[0] == 0), row, self.first)

    def check(self) -> None:
        """Raise :class:`~memfit.errors.DivergenceError` if a step since the start was not finite (a host sync)."""
        if self.cfg.on_nonfinite == "stop":
            step, loss, grad_norm = self.first.tolist()
            if step:
                self._raise(int(step), loss, grad_norm, "on_nonfinite=stop")

    def _raise(self, step: int, loss: float, grad_norm: float, why: str) -> None:
        lr = self.cfg.optimizer.lr
        raise DivergenceError(
            f"training diverged at step {step}: loss {loss}, grad_norm {grad_norm} ({why}). Nothing non-finite was "
            f"saved: {ckpt_io.kept_checkpoint(self.out)}. Lower optimizer.lr (now {lr:g}), raise "
            f"optimizer.warmup_steps or set max_grad_norm, then resume=true; on_nonfinite=skip skips such steps"
        )  # every rank raises it (the loss and gradient norm are global): rank 0 alone prints it (cli)


def _validate(model: torch.nn.Module, data: RunData, eval_options: dict[str, Any]) -> dict[str, float]:
    """``val_loss``, and for a text dataset ``val_loss/<source>`` of every source (``val_loss`` is then their mean:
    every source is evaluated on the same number of tokens). NaN when there is nothing to validate on."""
    if not data.val_sources:
        return {"val_loss": evaluate(model, data.val_batches(), **eval_options)}
    losses = {
        f"val_loss/{name}": evaluate(model, batches(), **eval_options)
        for name, batches in data.val_sources.items()
    }
    return {"val_loss": sum(losses.values()) / len(losses), **losses}


def _tracked_step(tracker, model, optimizer, micro_batches, step_options, timeline: bool) -> StepResult:
    """:func:`~memfit.step.train_step` under the run's :class:`~memfit.memory.tracker.MemoryTracker`; with
    ``timeline`` the tracker also records the step's memory timeline (``tracker.timeline``)."""
    tracker.record_timeline = timeline
    if timeline:
        tracker.clear_timeline()
    with tracker:
        return train_step(model, optimizer, micro_batches, tracker=tracker, **step_options)


def _sample(cfg: TrainConfig, model, tokenizer, last_ckpt: Path | None, device: torch.device) -> str:
    """The text sampled at the end of a run (``sample.*``); sharded, from the whole model gathered from the
    checkpoint on rank 0 alone."""
    if cfg.sample.max_new_tokens == 0:
        return ""
    if dist_.world_size() > 1:
        model = load_for_generation(last_ckpt, device=device)[0]
    return generate_text(
        model,
        tokenizer,
        cfg.sample.prompt,
        max_new_tokens=cfg.sample.max_new_tokens,
        temperature=cfg.sample.temperature,
        top_k=cfg.sample.top_k,
        seed=cfg.seed,
        dtype=cfg.dtype,
        template=run_template(cfg, tokenizer),
    )


def _banner(cfg, verb, built, run: _Run, device, start_step) -> str:
    """The start-of-run line: what trains (from a local directory, or a Hub id at its commit and the cache's
    snapshot), on what (the run's :class:`~memfit.data.run.RunData`), in which batches, where; and when nothing can
    be validated on, why, at the start rather than only at the end."""
    tokenizer, data, seq_len, world = run.tokenizer, run.data, run.seq_len, run.world
    source, model, where = run.sources.get("checkpoint_dir"), cfg.model_source, ""
    if source is not None:
        model, where = source.label(), f"hub commit {source.commit[:12]} -> '{source.path}'; "
    elif cfg.checkpoint_dir is not None:
        where = "local directory; "
    read = run.sources.get("data.path")
    data_from = "" if read is None else f" from {read.describe()}"
    trainable = "" if built.num_trainable == built.num_params else f", {built.num_trainable:,} trainable"
    sharded = f" x {world} ranks ({cfg.distributed.strategy})" if world > 1 else ""
    sp, replicas = cfg.distributed.sequence_parallel, cfg.distributed.replicate
    fsdp = cfg.distributed.strategy
    if world > 1 and replicas > 1:  # hybrid sharding: FSDP2 shards within a replica
        fsdp = f"hybrid {fsdp}: {replicas} replicas x {world // replicas} shards"
    if world > 1 and sp > 1:
        sharded = (
            f" x {world // sp} data-parallel x {sp} sequence-parallel ranks ({fsdp} over all "
            f"{world}; {seq_len // sp} tokens of each sequence a rank)"
        )
    elif world > 1 and replicas > 1:
        sharded = f" x {world} ranks ({fsdp})"
    tp = cfg.distributed.tensor_parallel
    if world > 1 and tp > 1:
        sharded = (
            f" x {world // tp} data-parallel x {tp} tensor-parallel ranks ({fsdp} over "
            f"{world // tp}; each layer's heads and hidden units split {tp} ways)"
        )
    return (
        f"memfit {verb}: model {model} ({where}{built.num_params:,} parameters{trainable}), "
        f"tokenizer {tokenizer.kind} ({tokenizer.vocab_size:,} ids), {data.summary}{data_from}, "
        f"batch {cfg.batch_size} x {cfg.gradient_accumulation_steps} x {seq_len} tokens{sharded}, dtype {cfg.dtype}"
        + (
            f" ({switches.resolved_rounding(cfg, device.type, world)} rounding)"
            if cfg.dtype == "bf16"
            else ""
        )
        + f", device {device}"
        + (
            f", optimizer {cfg.optimizer.name} ({split})"
            if (split := describe_partition(built.model, cfg.optimizer.name))
            else ""
        )
        + (f", resuming at step {start_step}" if start_step else "")
        + (f"; {data.val_empty_reason}" if data.val_empty_reason else "")
    )
