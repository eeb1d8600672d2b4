"""Messages a user can act on: every option's help gives its default, every bad option value exits 2 naming the
option, progress bars only on a terminal, estimates of small runs in MiB, the real reason validation is empty,
and one permission mode for every file memfit writes."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import logging
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from memfit import cli
from memfit import train as train_mod
from memfit.cli import build_parser, main
from memfit.config import config_from_dict, describe_keys, load_config, show_progress
from memfit.convert.peft_adapter import save_peft_adapter
from memfit.data.instruct import split_indices
from memfit.data.run import instruct_data
from memfit.errors import DataError
from memfit.filemode import current_umask, default_file_mode
from memfit.models.decoder import build_decoder
from memfit.models.peft import apply_lora
from memfit.models.presets import model_config
from memfit.planner.estimate import estimate_run
from memfit.planner.report import format_estimate
from memfit.quiet import compile_on_first_call, quiet_bitsandbytes_import, quiet_torchao_import
from memfit.tokenizer import train_bpe
from memfit.units import GIB, MIB

from .conftest import tiny_run_overrides

pytestmark = pytest.mark.usefixtures("one_thread")

MIXED = Path(__file__).parent / "assets" / "mixed_corpus"


# ----------------------------------------------------------------------------------------------------------------
# Help: every option of every verb says what it does and its default


def _verbs() -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


@pytest.mark.parametrize("verb", list(_verbs()))
def test_every_option_has_help_that_gives_its_default(verb):
    parser = _verbs()[verb]
    options = [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]
    assert options
    for action in options:
        assert action.help and action.help.strip(), f"{verb} {action.dest} has no help"
        if action.option_strings and action.nargs != 0:  # takes a value
            wanted = "(required)" if action.required else "(default: "
            assert wanted in action.help, f"{verb} {action.option_strings[0]}: {action.help!r}"


def test_config_keys_whose_default_needs_words_say_it():
    assert "progress_bar = None  (auto: shown when stderr is a terminal)" in describe_keys()
    # left out, the optimizer depends on the run (config.default_optimizer): the dataclass's 'adamw' is not shown
    assert (
        "optimizer.name = 'muon' | 'adamw'  (muon from scratch, adamw from pretrained weights)"
        in describe_keys()
    )


# ----------------------------------------------------------------------------------------------------------------
# Options are validated like config keys: exit 2, the option and the value named


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["prepare", "--out", "OUT", "--source", "a=x.txt", "--workers", "0"], "--workers must be >= 1"),
        (["prepare", "--out", "OUT", "--source", "a=x.txt", "--workers", "-1"], "--workers must be >= 1"),
        (["prepare", "--out", "", "--source", "a=x.txt"], "--out must be a path, not empty, got ''"),
        (
            ["prepare", "--out", "OUT", "--tokenizer", " ", "--source", "a=x.txt"],
            "--tokenizer must be a path",
        ),
        (["prepare", "--out", "OUT", "--source-tree", ""], "--source-tree must be a path, not empty, got ''"),
        (["export", "--checkpoint", "", "--out", "OUT"], "--checkpoint must be a path, not empty, got ''"),
        (["export", "--checkpoint", "CKPT", "--out", ""], "--out must be a path, not empty, got ''"),
        (["export", "--checkpoint", "CKPT", "--out", "OUT", "--max-shard-size", "-1"], "got -1.0"),
        (["export", "--checkpoint", "CKPT", "--out", "OUT", "--max-shard-size", "nan"], "got nan"),
        (["export", "--checkpoint", "CKPT", "--out", "OUT", "--max-shard-size", "inf"], "got inf"),
        (["generate", "--checkpoint", ""], "--checkpoint must be a path, not empty, got ''"),
        (
            ["generate", "--checkpoint", "CKPT", "--temperature", "nan"],
            "--temperature must be >= 0 (0: greedy)",
        ),
        (["generate", "--checkpoint", "CKPT", "--seed", "-1"], "--seed must be in [0, 2**64), got -1"),
        # each of the three options named with its value (not one line naming all three)
        (
            ["generate", "--checkpoint", "CKPT", "--top-k", "-1"],
            "--top-k must be >= 0 (0: no top-k restriction), got -1\n",
        ),
        (
            ["generate", "--checkpoint", "CKPT", "--max-new-tokens", "-5"],
            "--max-new-tokens must be >= 0, got -5\n",
        ),
        (
            ["generate", "--checkpoint", "CKPT", "--temperature", "-0.5"],
            "--temperature must be >= 0 (0: greedy), got -0.5\n",
        ),
        (["plan", "budget=1GiB", "--top", "0"], "--top must be >= 1 (rows of the table), got 0"),
        (
            ["plan", "budget=1GiB", "--fits", "0"],
            "--fits must be >= 1 (fitting combinations to establish), got 0",
        ),
        (
            ["plan", "budget=1GiB", "--margin", "1"],
            "--margin must be in [0, 1) (a fraction of the budget), got 1.0",
        ),
        (["plan", "budget=1GiB", "--out", ""], "--out must be a path, not empty, got ''"),
        (["estimate", "--config", ""], "--config must be a path, not empty, got ''"),
    ],
)
def test_a_bad_option_exits_2_naming_it(argv, message, tmp_path, capsys):
    names = {"OUT": str(tmp_path / "out"), "CKPT": str(tmp_path / "missing")}
    assert main([names.get(a, a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("memfit: config error: ") and message in err
    assert not (tmp_path / "out").exists()


def test_export_max_shard_size_message(tmp_path, capsys):
    argv = ["export", "--checkpoint", "x", "--out", str(tmp_path / "o"), "--max-shard-size", "0"]
    assert main(argv) == 2
    assert "--max-shard-size must be > 0 (GiB per safetensors file), got 0.0" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------------------
# Progress bars: on a terminal, or when asked


class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_progress_bar_auto_follows_stderr_and_true_or_false_decide(monkeypatch):
    monkeypatch.setattr("sys.stderr", _Stream(tty=False))
    assert (show_progress(None), show_progress(True), show_progress(False)) == (False, True, False)
    monkeypatch.setattr("sys.stderr", _Stream(tty=True))
    assert (show_progress(None), show_progress(True), show_progress(False)) == (True, True, False)
    monkeypatch.setattr("sys.stderr", None)  # pythonw, a closed stderr
    assert show_progress(None) is False
    assert load_config(None, []).progress_bar is None
    assert load_config(None, ["progress_bar=true"]).progress_bar is True


@pytest.mark.parametrize(("flag", "shown"), [(None, False), ("--progress", True), ("--quiet", False)])
def test_prepare_shows_its_bar_only_on_a_terminal_or_when_asked(flag, shown, tmp_path, capsys):
    argv = ["prepare", "--out", str(tmp_path / "d"), "--source", f"book={MIXED / 'book'}", "--workers", "1"]
    assert main([*argv, *([flag] if flag else []), "vocab_size=300"]) == 0
    assert ("prepare: 100%" in capsys.readouterr().err) is shown  # capsys' stderr is not a terminal


def test_progress_and_quiet_together_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["prepare", "--out", str(tmp_path / "d"), "--source", "a=x", "--progress", "--quiet"])
    assert exc.value.code == 2
    assert "--quiet: not allowed with argument --progress" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------------------
# Third-party import noise stays out of memfit's output


@pytest.mark.slow
def test_torchao_optimizers_import_without_a_word():
    pytest.importorskip("torchao")
    code = "from memfit.memory.optimizers import spec; spec('torchao_adamw8bit').factory()"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert (done.stdout, done.stderr) == ("", "")


# A CPU with AVX512-BF16 (where bitsandbytes looks for a 4-bit kernel of the `kernels` package, and logs that it is
# missing), made of any CPU: bitsandbytes' native library says it has the instructions.
_AVX512_BF16 = """
import importlib.machinery, sys
sys.modules["kernels"] = None  # not installed, or not importable
class AVX512BF16:
    def find_spec(self, name, path, target=None):
        if name != "bitsandbytes.cextension":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module
        def exec_module(module):
            run(module)
            module.lib.has_avx512bf16_cpu = lambda: True
        spec.loader.exec_module = exec_module
        return spec
sys.meta_path.insert(0, AVX512BF16())
"""


@pytest.mark.slow
def test_bitsandbytes_optimizers_import_without_a_word():
    pytest.importorskip("bitsandbytes")
    code = _AVX512_BF16 + (
        "from memfit.config import OptimizerConfig\n"
        "from memfit.memory.optim import _optimizer_class\n"
        "_optimizer_class(OptimizerConfig(name='adamw8bit'))\n"
        "import bitsandbytes.backends.cpu.ops as ops\n"
        # the kernel look-up ran, failed and logged "Failed to load CPU gemm_4bit_forward from kernels-community"
        "assert ops.gemm_4bit_forward_kernel is None\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")


def test_only_torchao_import_notes_are_dropped_and_only_while_importing(caplog):
    with quiet_torchao_import():
        logging.getLogger("torchao").warning("Failed to load /x/_C_mxfp8.so: Could not load this library")
        logging.getLogger("torch.utils._pytree").warning(
            "<enum 'K'> is an Enum subclass and is now natively supported by torch.compile as an opaque value type."
        )
        logging.getLogger("torchao").warning("something else")
    logging.getLogger("torchao").warning("Failed to load /x/_C_mxfp8.so: later")
    assert [r.getMessage() for r in caplog.records] == [
        "something else",
        "Failed to load /x/_C_mxfp8.so: later",
    ]
    caplog.clear()
    bnb = logging.getLogger("bitsandbytes.backends.cpu.ops")
    with quiet_bitsandbytes_import():
        bnb.warning("Failed to load CPU gemm_4bit_forward from kernels-community: No module named 'kernels'.")
        bnb.warning("something else")
    bnb.warning("Failed to load CPU gemm_4bit_forward from kernels-community: later")
    assert [r.getMessage() for r in caplog.records] == [
        "something else",
        "Failed to load CPU gemm_4bit_forward from kernels-community: later",
    ]


def test_compile_on_first_call_compiles_a_function_at_its_first_call_and_only_inside(monkeypatch):
    compiled_now = []

    def fake_compile(model=None, **options):
        compiled_now.append((getattr(model, "__name__", type(model).__name__), options))
        return lambda *a, **k: ("compiled", model(*a, **k))

    monkeypatch.setattr(torch, "compile", fake_compile)
    module = torch.nn.Linear(2, 2)
    with compile_on_first_call():

        @torch.compile(dynamic=False)
        def double(x):
            return 2 * x

        triple = torch.compile(lambda x: 3 * x)
        assert compiled_now == []  # nothing compiled at decoration
        torch.compile(module)  # a module is not deferred: torch.compile has it at once
        assert compiled_now == [("Linear", {})]
    assert torch.compile is fake_compile
    assert double.__name__ == "double"
    # each function compiled once, at its first call
    assert (double(4), double(5), triple(1)) == (("compiled", 8), ("compiled", 10), ("compiled", 3))
    assert compiled_now == [("Linear", {}), ("double", {"dynamic": False}), ("<lambda>", {})]


@pytest.mark.slow
def test_bitsandbytes_imports_without_torch_inductor():
    """bitsandbytes wraps its CPU kernels in ``torch.compile`` at import; memfit defers that to their first call,
    so an estimate never imports ``torch._inductor`` (~1 s) for them."""
    pytest.importorskip("bitsandbytes")
    probe = (
        "import sys\nfrom memfit.memory.optimizers import _bitsandbytes\n_bitsandbytes()\n"
        "import torch\nprint('bitsandbytes' in sys.modules, 'torch._inductor.compile_fx' in sys.modules, "
        "torch.compile.__module__)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.splitlines()[-1] == "True False torch"


# ----------------------------------------------------------------------------------------------------------------
# memfit estimate: MiB below 1 GiB, as memfit plan


def test_estimate_report_is_in_mib_below_one_gib_and_in_gib_above():
    cfg = load_config(None, ["model=tiny", "tokenizer.kind=char", "batch_size=2", "seq_len=16", "device=cpu"])
    e = estimate_run(cfg)
    text = format_estimate(e)
    assert f"peak memory: {e.peak_bytes / MIB:.2f} MiB (allocator), in {e.phase}" in text
    assert "device total" not in text  # no driver on a CPU: its total is the peak
    e = dataclasses.replace(e, config={**e.config, "device": "cuda"})
    on_cuda = format_estimate(e)
    assert f"device total (as the driver shows it): {e.device_total_bytes / MIB:.2f} MiB" in on_cuda
    # the predicted peak RSS has its own unit: it includes this (test) process's resident set, which may be GiB
    assert "GiB" not in "\n".join(line for line in text.splitlines() if "host peak RSS" not in line)
    big = dataclasses.replace(
        e, peak_bytes=3 * GIB // 2, device_total_bytes=2 * GIB, host_peak_rss_bytes=None
    )
    text = format_estimate(big)
    assert f"peak memory: 1.50 GiB (allocator), in {e.phase}" in text
    assert "device total (as the driver shows it): 2.00 GiB" in text
    assert "MiB" not in text


# ----------------------------------------------------------------------------------------------------------------
# Empty validation: the real cause, and the key to change


@pytest.fixture(scope="module")
def bpe():
    return train_bpe([json.dumps([{"instruction": "Say hi.", "output": "hi"}] * 20)], 300)


def _instruct_cfg(path: Path, val_fraction: float = 0.5):
    tree = {"data": {"path": str(path), "format": "alpaca", "val_fraction": val_fraction}, "seq_len": 160}
    return config_from_dict(tree, check=False)


def _records(tmp_path: Path, long_at: int) -> Path:
    records = [{"instruction": "Say hi.", "output": "hi"}] * 2
    records[long_at] = {"instruction": "a long prompt " * 40, "output": "ok"}  # truncated inside the prompt
    path = tmp_path / "records.json"
    path.write_text(json.dumps(records), encoding="utf-8")
    return path


def test_validation_emptied_by_truncation_says_so(tmp_path, bpe):
    (val,) = split_indices(2, 0.5, seed=1337)[1]  # the record held out (seed: TrainConfig's default)
    cfg = _instruct_cfg(_records(tmp_path, int(val)))
    data = instruct_data(cfg, bpe, 160)
    assert data.val_empty_reason == (
        "no validation samples: the 1 record data.val_fraction=0.5 held out was dropped: 1 had no reply token "
        "left after truncation to 161 tokens (raise seq_len, at most the model's max_seq_len)"
    )
    assert list(data.val_batches()) == []


def test_validation_off_or_impossible_names_val_fraction(tmp_path, bpe):
    data = instruct_data(_instruct_cfg(_records(tmp_path, 0), val_fraction=0.0), bpe, 160)
    assert data.val_empty_reason == "no validation samples: data.val_fraction=0"
    one = tmp_path / "one.json"
    one.write_text(json.dumps([{"instruction": "Say hi.", "output": "hi"}]), encoding="utf-8")
    data = instruct_data(_instruct_cfg(one), bpe, 160)
    assert data.val_empty_reason == (
        "no validation samples: data.val_fraction=0.5 holds out none of 1 record (it takes 2 or more)"
    )


def test_no_training_sample_names_the_key_that_sets_the_length(tmp_path, bpe):
    path = tmp_path / "one.json"
    path.write_text(json.dumps([{"instruction": "a long prompt " * 40, "output": "ok"}]), encoding="utf-8")
    cfg = _instruct_cfg(path)
    with pytest.raises(
        DataError, match=r"truncation to 161 tokens \(raise seq_len, at most the model's max_seq_len\)"
    ):
        instruct_data(cfg, bpe, 160)
    cfg = dataclasses.replace(cfg, seq_len=0)
    with pytest.raises(
        DataError, match=r"seq_len is 0, the model's max_seq_len: raise model_args.max_seq_len\)"
    ):
        instruct_data(cfg, bpe, 160)
    cfg = dataclasses.replace(cfg, checkpoint_dir=str(tmp_path))
    with pytest.raises(DataError, match="already the checkpoint's max_seq_len: shorten the records"):
        instruct_data(cfg, bpe, 160)


def test_summary_prints_the_reason(capsys):
    summary = {"final_val_loss": None, "checkpoint": "c", "sample": ""}
    cli._print_summary({**summary, "val_empty_reason": "no validation samples: data.val_fraction=0"})
    assert (
        "final validation loss: none (no validation samples: data.val_fraction=0)" in capsys.readouterr().out
    )
    cli._print_summary(summary)
    assert "final validation loss: none (no validation samples)\n" in capsys.readouterr().out


def test_summary_gives_the_fullest_rank_s_peak(monkeypatch, capsys):
    """A sharded run's summary gives each peak as the maximum over ranks and names that rank (issue 22, item 7:
    rank 0's own peak was printed, 2.589 GiB, where rank 1 reached 2.706 GiB)."""
    ranks = [  # what each rank measured over its run (GiB); CPU: no allocator fields
        {"peak_memory_rss": 2.589},
        {"peak_memory_rss": 2.706},
    ]
    monkeypatch.setattr(train_mod.dist_, "all_gather_objects", lambda mine: ranks)
    peaks = train_mod.run_peaks(ranks[0])  # rank 0's call: it learns every rank's
    assert peaks == {"peak_memory_rss": 2.706, "peak_memory_by_rank": {"peak_memory_rss": [2.589, 2.706]}}
    summary = {"final_val_loss": 1.5, "checkpoint": "c", "sample": ""}
    cli._print_summary({**summary, **peaks})
    assert "\npeak_memory_rss: 2.706 GiB (rank 1; lowest 2.589 GiB, rank 0)\n" in capsys.readouterr().out

    cuda = [
        {"peak_memory_alloc": 3.25, "peak_memory_device": 4.0},
        {"peak_memory_alloc": 3.25, "peak_memory_device": 4.5},
    ]
    monkeypatch.setattr(train_mod.dist_, "all_gather_objects", lambda mine: cuda)
    cli._print_summary({**summary, **train_mod.run_peaks(cuda[1])})
    out = capsys.readouterr().out
    assert (
        "\npeak_memory_alloc: 3.250 GiB (every rank)\n"
        "peak_memory_device: 4.500 GiB (rank 1; lowest 4.000 GiB, rank 0)\n" in out
    )

    monkeypatch.undo()  # one process: its own peak, no ranks
    peaks = train_mod.run_peaks({"peak_memory_rss": 1.261})
    assert peaks == {"peak_memory_rss": 1.261}
    cli._print_summary({**summary, **peaks})
    assert "\npeak_memory_rss: 1.261 GiB\n" in capsys.readouterr().out


# ----------------------------------------------------------------------------------------------------------------
# One permission mode: 0o666 less the umask, for every file written


@contextlib.contextmanager
def umask(mask: int):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def _modes(directory: Path) -> dict[str, int]:
    return {
        str(p.relative_to(directory)): stat.S_IMODE(p.stat().st_mode)
        for p in directory.rglob("*")
        if p.is_file()
    }


@pytest.fixture(scope="module")
def written(tmp_path_factory, small_corpus) -> Path:
    """A tiny run (its dataset prepared by it), its export and a LoRA adapter, written under umask 027."""
    root = tmp_path_factory.mktemp("modes")
    with umask(0o027):
        assert current_umask() == 0o027 and default_file_mode() == 0o640
        extra = {"max_steps": 2, "checkpoint_every": 0, "eval_every": 0, "sample.max_new_tokens": 0}
        assert main(["pretrain", *tiny_run_overrides(small_corpus, root / "run", **extra)]) == 0
        assert main(["export", "--checkpoint", str(root / "run"), "--out", str(root / "hf")]) == 0
        model = build_decoder(model_config("tiny"), seed=0)
        apply_lora(model)
        save_peft_adapter(model, root / "adapter")
    return root


def test_dataset_shards_exports_and_adapters_get_the_umask_mode(written):
    for part, must in (
        ("run/data", ".bin"),
        ("hf", "model.safetensors"),
        ("adapter", "adapter_model.safetensors"),
    ):
        modes = _modes(written / part)
        assert any(name.endswith(must) for name in modes), part
        assert set(modes.values()) == {0o640}, (part, modes)


def test_checkpoint_files_get_the_umask_mode(written):
    modes = _modes(written / "run" / "checkpoints")
    assert any(name.endswith("model.safetensors") for name in modes)
    assert {name: mode for name, mode in modes.items() if mode != 0o640} == {}


def test_the_front_page_is_the_full_parsers(capsys):
    """``memfit --help`` is answered before torch is imported (memfit/verbs.py), with the page the full parser
    prints; ``--version`` too."""
    from memfit import verbs
    from memfit.cli import build_parser

    assert verbs.front_parser().format_help() == build_parser().format_help()
    with pytest.raises(SystemExit) as stop:
        verbs.front_page(["--version"])
    assert stop.value.code == 0 and capsys.readouterr().out.startswith("memfit ")
    assert (
        verbs.front_page(["estimate", "--help"]) is False
    )  # a verb's own page needs its keys: the full parser


@pytest.mark.slow
def test_memfit_help_in_a_fresh_interpreter_imports_no_torch():
    import subprocess
    import sys as _sys

    probe = (
        "import sys, runpy; sys.argv = ['memfit', '--help']\n"
        "try:\n    runpy.run_module('memfit', run_name='__main__')\n"
        "except SystemExit as e:\n    assert e.code == 0\n"
        "print('torch imported' if 'torch' in sys.modules else 'no torch')\n"
    )
    out = subprocess.run([_sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[-1] == "no torch"
    assert "predict a run's peak memory" in out


@pytest.mark.slow
def test_the_cli_imports_no_fsdp_and_no_distributed_checkpointing_until_a_run_needs_them():
    """``import memfit.cli`` (every verb's start) leaves out torch.distributed.fsdp, DTensor and
    torch.distributed.checkpoint (~0.9 s of imports): only sharded runs and their checkpoints import them."""
    import subprocess
    import sys as _sys

    heavy = ["torch.distributed.fsdp", "torch.distributed.tensor", "torch.distributed.checkpoint"]
    probe = f"import sys, memfit.cli\nprint([m for m in {heavy!r} if m in sys.modules])\n"
    out = subprocess.run([_sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[-1] == "[]"
