"""A picture of a tracked step: live bytes by category over the ops, as
:class:`~memfit.memory.tracker.MemoryTracker` recorded them in its
:attr:`~memfit.memory.tracker.MemoryTracker.timeline`.

The tracker counts, this module draws; nothing here is needed to track.
"""

from __future__ import annotations

from pathlib import Path

from memfit import storage
from memfit.errors import WriteError
from memfit.memory.tracker import CATEGORIES
from memfit.units import GIB

_COLORS = {
    "parameters": "#4c72b0",
    "unsharded_parameters": "#64b5cd",
    "gradients": "#dd8452",
    "optimizer_state": "#55a868",
    "activations": "#c44e52",
    "temporaries": "#8172b3",
}
"""The colour of each category's band (a key for every name of :data:`~memfit.memory.tracker.CATEGORIES`)."""
_PHASE_SHADES = {"forward": "#f2f2f2", "backward": "#e0e0e0", "optimizer_step": "#cfcfcf", "other": "#ffffff"}
"""The background of each phase (a key for every name of :data:`~memfit.memory.tracker.PHASES`)."""


def plot_timeline(timeline: list[tuple[int, str, dict[str, int]]], path: str | Path, title: str = "") -> Path:
    """Stacked-area plot of live bytes by category over the tracked ops, phases shaded behind.

    Categories that are 0 over the whole timeline (``unsharded_parameters`` of a model that is not sharded, say)
    are left out of the plot and its legend.

    Args:
        timeline: :attr:`MemoryTracker.timeline <memfit.memory.tracker.MemoryTracker.timeline>`:
            ``(event index, phase, {category: bytes})`` after each op.
        path: the PNG to write (its directory is created).
        title: the plot title.

    Returns:
        ``path`` as a ``Path``.

    Raises:
        ValueError: the timeline is empty.
    """
    if not timeline:
        raise ValueError("plot_timeline: the timeline is empty (was anything run inside the tracker?)")
    # deferred: importing matplotlib costs start-up time that a run which never plots should not pay
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    events = [e for e, _, _ in timeline]
    peak = max(sum(b.values()) for _, _, b in timeline)
    unit, divisor = next((u, d) for u, d in (("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024), ("B", 1))
                         if peak >= d or d == 1)  # fmt: skip
    fig = Figure(figsize=(9, 4.5), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    start, width = 0, max(1, events[-1] - events[0])
    for i in range(1, len(timeline) + 1):  # shade each run of one phase, named when wide enough
        if i == len(timeline) or timeline[i][1] != timeline[start][1]:
            lo, hi, name = events[start] - 0.5, events[i - 1] + 0.5, timeline[start][1]
            ax.axvspan(lo, hi, color=_PHASE_SHADES[name], lw=0, zorder=0)
            if hi - lo > 0.08 * width:
                x_mid = (lo + hi) / 2
                ax.text(x_mid, 1.01, name, transform=ax.get_xaxis_transform(), ha="center", fontsize=8)
            start = i
    shown = [c for c in CATEGORIES if any(b.get(c, 0) for _, _, b in timeline)]
    ax.stackplot(events, *[[b[c] / divisor for _, _, b in timeline] for c in shown],
                 labels=shown, colors=[_COLORS[c] for c in shown], zorder=1)  # fmt: skip
    ax.set_xlabel("op (event index)")
    ax.set_ylabel(f"live memory ({unit}, {'1024**3' if unit == 'GiB' else 'powers of 1024'} bytes)")
    ax.set_title(title or "memory by category", pad=14)
    ax.margins(x=0)
    ax.legend(loc="upper left", fontsize="small")
    fig.tight_layout()
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path)
    except OSError as exc:
        path.unlink(missing_ok=True)
        raise WriteError(
            storage.write_failure("the memory timeline plot", path, exc, None, "output_dir")
        ) from None
    return path
