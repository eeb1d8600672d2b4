"""The Weights & Biases sink, offline: a tiny run logs the same records as metrics.jsonl, with the run's config,
into ``output_dir/wandb``; the keys are validated before anything runs."""

import json
import struct
import time
import zlib
from pathlib import Path

import pytest

from memfit.cli import main
from memfit.config import load_config
from memfit.errors import ConfigError
from memfit.metrics import MetricsLogger, flat_fields, read_records

from .conftest import tiny_run_overrides

pytest.importorskip("wandb")
pb = pytest.importorskip("wandb.proto.wandb_internal_pb2")


@pytest.fixture
def wandb_offline(monkeypatch, tmp_path):
    """W&B offline, its caches and settings in tmp_path instead of the home directory."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    for var in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))
    monkeypatch.delenv("WANDB_DIR", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


def read_wandb_log(path: Path) -> list:
    """The records of a ``.wandb`` transaction log, as wandb writes it (wandb-core's ``store`` package): a 7-byte
    header (``:W&B``, magic 0xBEE1, version 0), then LevelDB's log format (32 KiB blocks of chunks, each with a
    CRC-32 of its type and data, a little-endian length and a type: FULL, FIRST, MIDDLE, LAST), each whole
    record a ``wandb_internal_pb2.Record``."""
    data = path.read_bytes()
    assert data[:7] == b":W&B" + struct.pack("<HB", 0xBEE1, 0)
    block, pos, records, pending = 32768, 7, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's trailer: zero padding
            pos += block - pos % block
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:  # zero padding to the end of the block
            pos += block - pos % block
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc, f"bad checksum at byte {pos}"
        pos += 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
    assert pos == len(data), "the log ends with a torn chunk"
    return records


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def offline_run(output_dir: Path, wait_s: float = 30.0) -> tuple[dict, dict[int, dict], int | None]:
    """The one offline W&B run in ``output_dir/wandb``: its config, its history rows by step (without wandb's own
    ``_`` keys), and its exit code (``None`` if it never finished).

    ``run.finish()`` returns before wandb-core has written the exit record to the log (seen 1 time in 8 with wandb
    0.31, offline), so the log is read again, for up to ``wait_s`` seconds, until it holds one."""
    runs = list((output_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    (log,) = runs[0].glob("run-*.wandb")
    deadline = time.monotonic() + wait_s
    while True:
        try:
            config, history, exit_code = _read_run(log)
        except AssertionError:  # a chunk being written: torn until wandb-core finishes it
            if time.monotonic() > deadline:
                raise
            exit_code = None
        if exit_code is not None or time.monotonic() > deadline:
            return config, history, exit_code
        time.sleep(0.1)


def _read_run(log: Path) -> tuple[dict, dict[int, dict], int | None]:
    config, history, exit_code = {}, {}, None
    for record in read_wandb_log(log):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            config.update({u.key: json.loads(u.value_json) for u in record.run.config.update})
        elif kind == "config":
            config.update({_key(u): json.loads(u.value_json) for u in record.config.update})
        elif kind == "history":
            row = {_key(i): json.loads(i.value_json) for i in record.history.item}
            assert record.history.step.num not in history
            history[record.history.step.num] = {k: v for k, v in row.items() if not k.startswith("_")}
        elif kind == "exit":
            exit_code = record.exit.exit_code
    config.pop("_wandb", None)
    return config, history, exit_code


def test_a_run_logs_the_same_records_and_its_config_offline(small_corpus, tmp_path, wandb_offline):
    out = tmp_path / "run"
    overrides = tiny_run_overrides(
        small_corpus,
        out,
        max_steps=6,
        eval_every=3,
        checkpoint_every=0,
        track_memory=True,  # memory_breakdown and memory_category_peaks: nested, flattened for W&B
        seed=7,
        wandb=True,
        wandb_project="memfit-test",
        **{"optimizer.lr": 3e-3},
    )
    assert main(["pretrain", *overrides]) == 0

    config, history, exit_code = offline_run(out)
    assert exit_code == 0
    # every record of metrics.jsonl (training and validation), flattened, at its step: a step's records are one row
    records = read_records(out / "metrics.jsonl")
    expected: dict[int, dict] = {}
    for r in records:
        expected.setdefault(r["step"], {}).update(flat_fields(r))
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 7))
    assert [r["step"] for r in records if "val_loss" in r] == [3, 6]
    assert history == expected  # the same steps, keys and values (floats as JSON round-trips them: exactly)
    assert "memory_breakdown/parameters" in history[1] and "memory_breakdown" not in history[1]
    assert [history[s]["loss"] for s in range(1, 7)] == [r["loss"] for r in records if "loss" in r]
    # the run's full config, as the checkpoint records it
    state = json.loads((out / "checkpoints" / "step_00000006" / "trainer_state.json").read_text())
    assert config == state["config"]
    assert (
        config["seed"] == 7 and config["optimizer"]["lr"] == 3e-3 and config["wandb_project"] == "memfit-test"
    )


def test_a_failed_run_ends_its_wandb_run_as_failed(tmp_path, wandb_offline):
    with pytest.raises(RuntimeError, match="boom"):
        with MetricsLogger(
            tmp_path, tensorboard=False, wandb_project="memfit-test", run_config={"seed": 1}
        ) as log:
            log.log({"step": 1, "loss": 2.5, "mfu": None, "memory_breakdown": {"activations": 0.5}})
            raise RuntimeError("boom")
    config, history, exit_code = offline_run(tmp_path)
    assert exit_code == 1
    assert config == {"seed": 1} and history == {1: {"loss": 2.5, "memory_breakdown/activations": 0.5}}


def test_no_wandb_run_unless_asked(tmp_path):
    assert load_config(None).wandb is False
    with MetricsLogger(tmp_path, tensorboard=False) as log:
        log.log({"step": 1, "loss": 1.0})
    assert not (tmp_path / "wandb").exists()


def test_flat_fields():
    record = {
        "step": 3,
        "loss": 1.5,
        "mfu": None,
        "memory_peak_phase": "backward",
        "memory_breakdown": {"a": 1.0},
    }
    assert flat_fields(record) == {"loss": 1.5, "memory_peak_phase": "backward", "memory_breakdown/a": 1.0}


def test_wandb_needs_a_project_and_the_package(monkeypatch):
    with pytest.raises(ConfigError, match="'wandb_project'"):
        load_config(None, ["wandb=true"])
    assert load_config(None, ["wandb=true", "wandb_project=p"]).wandb_project == "p"

    import memfit.validation as config_module  # where the wandb check lives

    find_spec = config_module.importlib.util.find_spec
    monkeypatch.setattr(
        config_module.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "wandb" else find_spec(name, *a),
    )
    with pytest.raises(ConfigError, match="'wandb'") as info:
        load_config(None, ["wandb=true", "wandb_project=p"])
    assert "pip install wandb" in str(info.value)
    load_config(None, ["wandb=false"])  # not needed when off
