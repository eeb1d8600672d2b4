"""Multi-node runs as docs/distributed.md tells them: two torchrun launchers ("nodes" of one rank each, on this host)
meet through the c10d rendezvous and share one ``output_dir``. They train what one process with the global batch
does; when one node is SIGKILLed mid-run the other's launch ends at once, the newest complete checkpoint is intact,
and both nodes started again with ``resume=true`` continue onto the uninterrupted run's losses. The same again with
two ranks a node in hybrid sharding (``distributed.replicate=2``: each node a replica, as on real clusters)."""

from __future__ import annotations

import socket
import subprocess
import time
import uuid
from pathlib import Path

import psutil
import pytest

from memfit import checkpoint as ckpt_io
from memfit.cli import main
from memfit.metrics import read_records

from .conftest import alive, kill_launch, rank_of, start_python, tiny_run_overrides

pytestmark = pytest.mark.slow

TOL = 1e-5  # as tests/test_distributed.py: fp32, 2 ranks reduce in another order than one process
MAX_STEPS = 16
CHECKPOINT_EVERY = 4  # the killed run: a checkpoint at step 4, then 12 more steps in which to kill a node
RUN = dict(max_steps=MAX_STEPS, eval_every=0, checkpoint_every=0, sample__max_new_tokens=0)
RUN_WITHIN_S = 180  # a two-node run takes about 10 s on 2 cores (most of it starting Python and torch, twice)
SURVIVOR_EXITS_WITHIN_S = 60  # gloo sees the dead node's closed socket at once (measured: 2-3 s to exit)


def _overrides(corpus: Path, out: Path, **extra) -> list[str]:
    extra = {k.replace("__", "."): v for k, v in {**RUN, **extra}.items()}
    return tiny_run_overrides(corpus, out, **extra)


def _start_nodes(args: list[str], nproc_per_node: int = 1) -> list[subprocess.Popen]:
    """Two launchers, each ``torchrun --nnodes 2 --nproc_per_node N`` with the c10d rendezvous on a free port of
    this host and a rendezvous id of their own, running ``memfit args``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rdzv = ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", uuid.uuid4().hex]
    torchrun = ["--nnodes", "2", "--nproc_per_node", str(nproc_per_node), *rdzv, "-m", "memfit", *args]
    return [start_python(torchrun, module="torch.distributed.run") for _ in range(2)]


def _tails(outputs: list[str | None]) -> str:
    return "".join(f"\n--- node {i}'s launcher:\n{(o or '')[-5000:]}" for i, o in enumerate(outputs))


def _finish(nodes: list[subprocess.Popen], timeout: float) -> list[str]:
    """Wait for every launcher, at most ``timeout`` seconds in all; past it, kill them all and fail with their
    output. Returns their outputs."""
    deadline = time.monotonic() + timeout
    while any(n.poll() is None for n in nodes) and time.monotonic() < deadline:
        time.sleep(0.1)
    late = [i for i, n in enumerate(nodes) if n.poll() is None]
    outputs = [kill_launch(n, []) if n.poll() is None else n.communicate(timeout=30)[0] for n in nodes]
    if late:
        pytest.fail(f"the launchers of nodes {late} did not exit within {timeout} s:{_tails(outputs)}")
    return outputs


def _losses(out: Path) -> list[tuple[int, float, float]]:
    return [
        (r["step"], r["loss"], r["grad_norm"]) for r in read_records(out / "metrics.jsonl") if "loss" in r
    ]


def _max_diff(run: list[tuple[int, float, float]], reference: list[tuple[int, float, float]], first: int = 1):
    """Largest |loss| and |grad_norm| differences from step ``first`` on (the steps must be the same)."""
    assert [s for s, *_ in run] == [s for s, *_ in reference] == list(range(1, MAX_STEPS + 1))
    pairs = [(a, b) for a, b in zip(run, reference, strict=True) if a[0] >= first]
    return max(abs(a[1] - b[1]) for a, b in pairs), max(abs(a[2] - b[2]) for a, b in pairs)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, small_corpus) -> list[tuple[int, float, float]]:
    """One process, in this one, with batch_size 8 (= 2 nodes x 1 rank x 4): step, loss and grad_norm per step."""
    out = tmp_path_factory.mktemp("one_process")
    assert main(["pretrain", *_overrides(small_corpus, out, batch_size=8)]) == 0
    return _losses(out)


# (ranks per node, per-rank batch, extra overrides, rank 0's banner): 2 nodes x 1 rank; 2 nodes x 2 ranks in hybrid
# sharding, each node a replica (its 2 ranks shard the model, gradients are all-reduced across the nodes); both
# global batches are 8
LAYOUTS = {
    "flat-2x1": (1, 4, {}, "x 2 ranks (fsdp2)"),
    "hybrid-2x2": (2, 2, {"distributed.replicate": 2}, "x 4 ranks (hybrid fsdp2: 2 replicas x 2 shards)"),
}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, small_corpus):
    """``layout -> (output dir, the launchers' outputs)`` of an uninterrupted two-node run (run once a layout)."""
    runs: dict[str, tuple[Path, list[str]]] = {}

    def run(layout: str) -> tuple[Path, list[str]]:
        if layout not in runs:
            nproc, batch_size, extra, _ = LAYOUTS[layout]
            out = tmp_path_factory.mktemp(layout) / "two_nodes"
            nodes = _start_nodes(
                ["pretrain", *_overrides(small_corpus, out, batch_size=batch_size, **extra)], nproc
            )
            outputs = _finish(nodes, RUN_WITHIN_S)
            assert [n.returncode for n in nodes] == [0, 0], _tails(outputs)
            runs[layout] = (out, outputs)
        return runs[layout]

    return run


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_nodes_train_what_one_process_does(layout, uninterrupted, reference):
    out, outputs = uninterrupted(layout)
    both = "".join(outputs)
    assert LAYOUTS[layout][3] in both, _tails(outputs)
    assert both.count("step 1 |") == 1 and both.count("final validation loss") == 1  # rank 0 alone logs
    loss, grad_norm = _max_diff(_losses(out), reference)
    print(f"max |2 nodes ({layout}) - 1 process x batch 8|: loss {loss:.2e}, grad_norm {grad_norm:.2e}")
    assert loss <= TOL and grad_norm <= TOL, _tails(outputs)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_killed_node_ends_the_run_and_both_resume_exactly(
    layout, uninterrupted, reference, small_corpus, tmp_path
):
    """SIGKILL of the node that holds rank 0 (the one that logs, holds the run's lock and renames checkpoints into
    place), its launcher and workers, once a checkpoint is complete; then both nodes again with ``resume=true``.
    In hybrid mode the killed node is a whole replica."""
    nproc, batch_size, extra, banner = LAYOUTS[layout]
    out = tmp_path / "run"
    args = [
        "pretrain",
        *_overrides(small_corpus, out, batch_size=batch_size, checkpoint_every=CHECKPOINT_EVERY, **extra),
    ]
    nodes = _start_nodes(args, nproc)
    outputs: list[str | None] = [None, None]
    workers: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + RUN_WITHIN_S
        while not ckpt_io.list_checkpoints(out):
            if any(n.poll() is not None for n in nodes) or time.monotonic() > deadline:
                outputs = [kill_launch(n, []) for n in nodes]
                pytest.fail(
                    f"no checkpoint was written before a launcher exited or {RUN_WITHIN_S} s:{_tails(outputs)}"
                )
            time.sleep(0.01)
        per_node = [psutil.Process(n.pid).children(recursive=True) for n in nodes]
        workers = [w for ws in per_node for w in ws]
        holds_rank_0 = [i for i, ws in enumerate(per_node) if "0" in [rank_of(w) for w in ws]]
        assert len(holds_rank_0) == 1, [[(w.pid, rank_of(w)) for w in ws] for ws in per_node]
        victim = holds_rank_0[0]
        survivor = 1 - victim
        outputs[victim] = kill_launch(nodes[victim], per_node[victim])
        killed_at = time.monotonic()
        try:
            outputs[survivor] = nodes[survivor].communicate(timeout=SURVIVOR_EXITS_WITHIN_S)[0]
        except subprocess.TimeoutExpired:
            outputs[survivor] = kill_launch(nodes[survivor], per_node[survivor])
            pytest.fail(
                f"the other node's launcher ran on {SURVIVOR_EXITS_WITHIN_S} s after the kill:{_tails(outputs)}"
            )
        print(
            f"node {survivor}'s launcher exited {time.monotonic() - killed_at:.1f} s after node {victim} was killed"
        )
    finally:
        for i, node in enumerate(nodes):
            if outputs[i] is None:
                outputs[i] = kill_launch(node, workers)
    assert nodes[survivor].returncode not in (0, None), _tails(outputs)
    assert not alive(workers), _tails(outputs)  # no worker left behind on either node

    # the newest complete checkpoint is intact: its files are all there at their recorded sizes and it consolidates
    newest = ckpt_io.list_checkpoints(out)[-1]
    step = int(newest.name.removeprefix("step_"))
    assert step < MAX_STEPS, f"the run ended before a node was killed:{_tails(outputs)}"
    state = ckpt_io.read_trainer_state(newest)
    assert state["step"] == step and state["world_size"] == 2 * nproc
    ckpt_io.check_files(newest, state, need_optimizer=True)
    assert ckpt_io.read_sharded_weights(newest)

    nodes = _start_nodes([*args, "resume=true"], nproc)
    outputs = _finish(nodes, RUN_WITHIN_S)
    assert [n.returncode for n in nodes] == [0, 0], _tails(outputs)
    assert "".join(outputs).count(f"resuming at step {step}") == 1, _tails(outputs)
    assert banner in "".join(outputs), _tails(outputs)  # hybrid: each node one replica
    assert ckpt_io.list_checkpoints(out)[-1].name == f"step_{MAX_STEPS:08d}"  # it ends at max_steps
    assert not [
        p.name for p in (out / "checkpoints").iterdir() if p.name.startswith(".")
    ]  # nothing partial left
    resumed = _max_diff(_losses(out), reference, first=step + 1)
    whole = _max_diff(_losses(out), reference)  # steps up to the checkpoint were the killed run's
    print(
        f"{layout}: resumed at step {step} on 2 nodes: max |loss, grad_norm| differences from 1 process x batch 8: "
        f"steps {step + 1}-{MAX_STEPS} {resumed[0]:.2e}, {resumed[1]:.2e}; all steps {whole[0]:.2e}, {whole[1]:.2e}"
    )
    assert max(*resumed, *whole) <= TOL, _tails(outputs)
    # and the steps after the checkpoint are the uninterrupted two-node run's (the same layout, the same sums)
    exact = [(s, loss) for s, loss, _ in _losses(uninterrupted(layout)[0]) if s > step]
    again = [(s, loss) for s, loss, _ in _losses(out) if s > step]
    print(
        f"{layout}: max |resumed - uninterrupted| loss, steps {step + 1}-{MAX_STEPS}: "
        f"{max(abs(a[1] - b[1]) for a, b in zip(again, exact, strict=True)):.2e}"
    )
    assert [s for s, _ in again] == [s for s, _ in exact]
    assert max(abs(a[1] - b[1]) for a, b in zip(again, exact, strict=True)) <= 1e-6
