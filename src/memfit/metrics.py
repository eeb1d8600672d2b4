"""The step record and its sinks: a readable stdout line, ``metrics.jsonl``, TensorBoard, Weights & Biases, and a
loss plot.

A step record is a flat dict. Training records carry ``step, loss, lr, grad_norm, tokens_per_second_per_gpu, mfu``
and the peak-memory fields of :mod:`memfit.memory.stats` (GiB); validation records carry ``step, val_loss``.
Memory fields are ``null`` in JSON when they do not apply to the device (allocator fields on CPU).
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from memfit import storage
from memfit.errors import ConfigError, WriteError

_STDOUT_FIELDS = (
    ("loss", "loss {:.4f}"),
    ("val_loss", "val_loss {:.4f}"),
    ("lr", "lr {:.2e}"),
    ("grad_norm", "grad_norm {:.3f}"),
    ("rewards/margins", "margin {:.3f}"),
    ("rewards/accuracies", "reward_acc {:.0%}"),
    ("tokens_per_second_per_gpu", "tok/s/gpu {:,.0f}"),
    ("mfu", "mfu {:.1%}"),
    ("peak_memory_active", "active {:.2f} GiB"),
    ("peak_memory_alloc", "alloc {:.2f} GiB"),
    ("peak_memory_reserved", "reserved {:.2f} GiB"),
    ("peak_memory_device", "device {:.2f} GiB"),
    ("peak_memory_rss", "rss {:.2f} GiB"),
)


def format_record(record: dict[str, Any]) -> str:
    """One readable line, e.g. ``step 10 | loss 5.1234 | lr 1.00e-04 | ... | rss 0.71 GiB``."""
    parts = [f"step {record['step']}"]
    for key, fmt in _STDOUT_FIELDS:
        value = record.get(key)
        if value is not None:
            parts.append(fmt.format(value))
    per_source = {k.split("/", 1)[1]: v for k, v in record.items() if k.startswith("val_loss/")}
    if len(per_source) > 1:
        parts[-1] += " (" + ", ".join(f"{name} {v:.4f}" for name, v in per_source.items()) + ")"
    breakdown = record.get("memory_breakdown")
    if breakdown:
        cats = ", ".join(f"{k} {v:.3f}" for k, v in breakdown.items())
        rank = f" on rank {record['memory_peak_rank']}" if "memory_peak_rank" in record else ""
        parts.append(
            f"tracked peak {sum(breakdown.values()):.3f} GiB in {record.get('memory_peak_phase')}{rank} ({cats})"
        )
    return " | ".join(parts)


class Throughput:
    """``tokens_per_second_per_gpu`` of the steps since the last record, and of the whole run.

    A step's time runs from the start of its step to the moment its record is written (or, between records, to the
    end of its step), so a logged interval includes its one host sync.
    """

    def __init__(self) -> None:
        self.interval_seconds, self.interval_tokens = 0.0, 0
        self.total_seconds, self.total_tokens = 0.0, 0

    def add(self, seconds: float, tokens: int) -> None:
        """Count one step: ``tokens`` of this rank in ``seconds``."""
        self.interval_seconds += seconds
        self.interval_tokens += tokens

    def interval_rate(self) -> float:
        """Tokens per second since the last call (or the start); the interval then starts anew."""
        rate = self.interval_tokens / max(self.interval_seconds, 1e-9)
        self.total_seconds += self.interval_seconds
        self.total_tokens += self.interval_tokens
        self.interval_seconds, self.interval_tokens = 0.0, 0
        return rate

    @property
    def run_rate(self) -> float | None:
        """Tokens per second over every logged interval of the run, ``None`` before the first."""
        return self.total_tokens / self.total_seconds if self.total_seconds else None


def flat_fields(record: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A record's values as one flat mapping for a metrics service: nested mappings (``memory_breakdown``) as
    ``<key>/<sub-key>``; ``step`` and ``None`` values left out."""
    out = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_fields(value, f"{name}/"))
        elif value is not None and name != "step":
            out[name] = value
    return out


def start_wandb_run(output_dir: Path, project: str, name: str | None, config: dict[str, Any] | None) -> Any:
    """A Weights & Biases run in ``output_dir/wandb`` (``WANDB_MODE=offline``: it stays there for ``wandb sync``),
    with the run's config; no console capture, code or git state saved.

    Raises:
        ConfigError: the run could not be started (not logged in, no network, ...), naming ``wandb``.
    """
    import wandb  # deferred: optional, and slow to import

    try:
        return wandb.init(
            project=project,
            name=name or Path(output_dir).name or None,
            dir=str(output_dir),
            config=config,
            settings=wandb.Settings(console="off", save_code=False, disable_git=True, quiet=True),
        )
    except Exception as exc:  # wandb's own errors (UsageError, CommError, ...) are not memfit's to know
        raise ConfigError(
            f"config key 'wandb': the Weights & Biases run could not be started ({type(exc).__name__}: {exc}); "
            f"log in with `wandb login`, or log offline (WANDB_MODE=offline, then `wandb sync`), or set "
            f"wandb=false"
        ) from exc


TENSORBOARD_MISSING = (
    "note: tensorboard=true, but the tensorboard package is not installed, so this run writes no TensorBoard "
    "events (pip install tensorboard)"
)
"""What a run that asked for TensorBoard events says, once, when the package is not installed."""


class MetricsLogger:
    """Writes step records to stdout (through tqdm, so the progress bar stays intact), JSONL, TensorBoard and
    Weights & Biases. A context manager: leaving it closes the sinks (a W&B run ends as failed on an exception).

    Args:
        output_dir: the run directory; records are appended to ``output_dir/metrics.jsonl``.
        tensorboard: also write TensorBoard scalars to ``output_dir/tensorboard``: ``None`` when the package is
            installed (silent when not), ``True`` the same but a note on stdout when it is not, ``False`` never.
        resume_step: on resume, records after this step (written by the interrupted run after its last
            checkpoint) are dropped from ``metrics.jsonl`` first, so the file reads like one uninterrupted run.
        enabled: ``False`` on non-zero ranks.
        wandb_project: also log every record (:func:`flat_fields`, at its ``step``) to a new W&B run of this
            project under ``output_dir/wandb`` (:func:`start_wandb_run`); ``None``: no W&B run.
        wandb_run_name: the W&B run's name; ``None``: the name of ``output_dir``.
        run_config: the run's configuration, recorded as the W&B run's config.
    """

    def __init__(
        self,
        output_dir: Path,
        tensorboard: bool | None = None,
        resume_step: int | None = None,
        enabled: bool = True,
        wandb_project: str | None = None,
        wandb_run_name: str | None = None,
        run_config: dict[str, Any] | None = None,
    ):
        self.enabled = enabled
        self.path = Path(output_dir) / "metrics.jsonl"
        self._tb = None
        self._wandb = None
        self._closed = False
        if not enabled:
            return
        if resume_step is None:
            if self.path.exists():
                self.path.unlink()
        else:
            truncate_records(self.path, resume_step)
        if tensorboard or tensorboard is None:
            try:
                from torch.utils.tensorboard import SummaryWriter  # deferred: optional, and slow to import
            except ImportError:
                if (
                    tensorboard
                ):  # asked for: said once, as the run's other notes; auto: the extra is not there
                    tqdm.write(TENSORBOARD_MISSING)
            else:
                self._tb = SummaryWriter(
                    log_dir=str(Path(output_dir) / "tensorboard"), purge_step=resume_step
                )
        self._file = open(self.path, "a", encoding="utf-8")
        if wandb_project is not None:
            try:
                self._wandb = start_wandb_run(Path(output_dir), wandb_project, wandb_run_name, run_config)
            except BaseException:
                self.close()
                raise

    def log(self, record: dict[str, Any]) -> None:
        """Write one record to every sink.

        Raises:
            WriteError: ``metrics.jsonl`` or the TensorBoard events could not be written (disk full, ...).
        """
        if not self.enabled:
            return
        tqdm.write(format_record(record))
        try:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
            if self._tb is not None:
                for key, value in record.items():
                    if key != "step" and isinstance(value, int | float) and math.isfinite(value):
                        self._tb.add_scalar(key, value, record["step"])
                self._tb.flush()
            if self._wandb is not None:
                self._wandb.log(flat_fields(record), step=record["step"])
        except OSError as exc:
            raise WriteError(
                storage.write_failure(
                    f"the step {record.get('step')} record to",
                    exc.filename or self.path,
                    exc,
                    "the records before it are in metrics.jsonl and the newest complete checkpoint in output_dir "
                    "is kept (resume=true continues from it)",
                    "output_dir",
                    partial=None,
                )
            ) from None

    def close(self, failed: bool = False) -> None:
        """Flush and close the sinks (once; later calls do nothing). ``failed``: the W&B run ends as failed."""
        if not self.enabled or self._closed:
            return
        self._closed = True
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish(exit_code=1 if failed else 0)

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        self.close(failed=exc_type is not None)


def read_records(path: Path, report: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` file.

    A line that is not a JSON object is skipped and reported: through ``report`` (default: a line on stderr)
    naming the file, the line number and what is wrong; the last line torn by a killed run is reported as such.
    """
    out = []
    path = Path(path)
    if not path.exists():
        return out
    say = report or (lambda message: print(message, file=sys.stderr))
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            record, why = None, f"not JSON ({exc})"
        else:
            why = "not a record (a JSON object with a step)"
        if isinstance(record, dict) and "step" in record:
            out.append(record)
            continue
        torn = " (the end of a line cut off when a run was killed)" if number == len(lines) else ""
        say(f"memfit: note: {path}, line {number}: {why}{torn}; skipped: {line[:80]!r}")
    return out


def truncate_records(path: Path, last_step: int, report: Callable[[str], None] | None = None) -> None:
    """Keep only the records with ``step <= last_step`` (atomically rewritten): on resume, the records an
    interrupted run wrote after its last checkpoint are dropped, and said to be (through ``report``, default
    stderr)."""
    path = Path(path)
    if not path.exists():
        return
    records = read_records(path, report)
    kept = [r for r in records if r.get("step", 0) <= last_step]
    if len(kept) < len(records):
        say = report or (lambda message: print(message, file=sys.stderr))
        later = sorted({r.get("step") for r in records if r.get("step", 0) > last_step})
        say(
            f"memfit: note: {len(records) - len(kept)} records of steps {later[0]}-{later[-1]} in {path} were "
            f"written after the checkpoint of step {last_step} that the run resumes from; they are replaced by "
            f"the resumed run's"
        )
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise WriteError(storage.write_failure("metrics", path, exc, None, "output_dir")) from None


def plot_losses(metrics_path: Path, png_path: Path) -> Path | None:
    """Plot train ``loss`` and ``val_loss`` (and with several sources each ``val_loss/<source>``) against step from a
    ``metrics.jsonl`` file into a PNG.

    Returns:
        ``png_path``, or ``None`` when there is nothing to plot.
    """
    import matplotlib  # deferred: slow to import, and needed only at the end of a run

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_records(metrics_path)
    train = [(r["step"], r["loss"]) for r in records if r.get("loss") is not None]
    val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    if not train and not val:
        return None
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    if train:
        ax.plot(*zip(*train, strict=True), label="train loss")
    if val:
        ax.plot(*zip(*val, strict=True), "o-", label="validation loss")
    sources = sorted({k for r in records for k in r if k.startswith("val_loss/")})
    for key in sources if len(sources) > 1 else []:  # one source: its loss is val_loss
        points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
        ax.plot(
            *zip(*points, strict=True), ".--", alpha=0.7, label=f"validation loss, {key.split('/', 1)[1]}"
        )
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    try:
        fig.savefig(png_path)
    except OSError as exc:
        Path(png_path).unlink(missing_ok=True)
        raise WriteError(
            storage.write_failure(
                "the loss plot", png_path, exc, "metrics.jsonl holds the same numbers", "output_dir"
            )
        ) from None
    finally:
        plt.close(fig)
    return Path(png_path)
