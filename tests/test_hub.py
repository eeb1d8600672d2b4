"""Checkpoints and datasets named by a Hugging Face Hub id, resolved with no network: from a cache built on disk in
huggingface_hub's own layout (tests/hub_cache.py), offline; where the Hub itself would answer (a gated repo, a
listing of files and sizes), huggingface_hub's download function is replaced by one that answers as it does.

The tiny pretrained checkpoint of tests/conftest.py is what the cache's snapshots hold."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx2
import pytest
import yaml
from huggingface_hub import constants
from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError
from huggingface_hub.file_download import DryRunFileInfo
from huggingface_hub.utils import filter_repo_objects
from safetensors.torch import load_file, save_file

from memfit import hub
from memfit.checkpoint import latest_checkpoint, read_trainer_state
from memfit.cli import main
from memfit.errors import CheckpointError
from tests.conftest import DOLLY, finetune_overrides
from tests.hub_cache import commit_sha, point_hub_at, put_snapshot

A, B = commit_sha("first"), commit_sha("second")


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """An empty Hugging Face cache, read offline."""
    return point_hub_at(tmp_path / "hf_cache", monkeypatch)


def files_of(directory: Path) -> dict[str, Path]:
    return {f.name: f for f in sorted(directory.iterdir()) if f.is_file()}


def lora_overrides(checkpoint: str | Path, out: Path, **extra) -> list[str]:
    extra = {"method": "lora", "max_steps": 2, **extra}
    return finetune_overrides(Path(checkpoint), out, **extra)


def hub_record(out: Path) -> dict | None:
    return read_trainer_state(latest_checkpoint(out)).get("hub")


def saved_config(out: Path) -> dict:
    return read_trainer_state(latest_checkpoint(out))["config"]


# ----------------------------------------------------------------------------------------------------------------
# Reading an id


def test_hub_ids_and_local_paths(tmp_path, monkeypatch):
    assert hub.hub_id("Qwen/Qwen3-0.6B") == ("Qwen/Qwen3-0.6B", None)
    assert hub.hub_id("meta-llama/Llama-3.2-1B@v1.0") == ("meta-llama/Llama-3.2-1B", "v1.0")
    assert hub.hub_id(f"org/name@{A}") == ("org/name", A)
    assert hub.hub_id("org/name@refs/pr/3") == ("org/name", "refs/pr/3")
    for path in ("/abs/dir", "./org/name", "a/b/c", "~/x/y", "org/..", "single", "org/name/", "data/*.jsonl"):
        assert hub.hub_id(path) is None, path
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert hub.hub_id("org/name") is None  # a local path of the same spelling wins
    assert hub.hub_id("org/other") == ("org/other", None)


def test_select_files():
    paths = [
        "README.md",
        "train.jsonl",
        "pretrain.txt",
        "data/train-00000-of-00002.parquet",
        "data/train-00001-of-00002.parquet",
        "data/test-00000-of-00001.parquet",
        "test/part0.jsonl.zst",
        ".cache/train.jsonl",
    ]
    assert hub.select_files(paths) == [
        "data/test-00000-of-00001.parquet",
        "data/train-00000-of-00002.parquet",
        "data/train-00001-of-00002.parquet",
        "pretrain.txt",
        "test/part0.jsonl.zst",
        "train.jsonl",
    ]
    assert hub.select_files(paths, split="train") == [
        "data/train-00000-of-00002.parquet",
        "data/train-00001-of-00002.parquet",
        "train.jsonl",
    ]
    assert hub.select_files(paths, split="test") == [
        "data/test-00000-of-00001.parquet",
        "test/part0.jsonl.zst",
    ]
    assert hub.select_files(paths, "data/*.parquet", "train") == [
        "data/train-00000-of-00002.parquet",
        "data/train-00001-of-00002.parquet",
    ]
    assert hub.select_files(paths, "*.jsonl", suffixes=hub.RECORD_SUFFIXES) == ["train.jsonl"]
    assert hub.snapshot_repo(f"/c/datasets--org--set/snapshots/{A}/data/x.txt") == ("dataset", "org/set", A)
    assert hub.snapshot_repo("/c/elsewhere/x") is None


# ----------------------------------------------------------------------------------------------------------------
# Checkpoints from the cache


def test_branch_tag_and_commit_revisions(hub_cache, hf_checkpoint):
    first = put_snapshot(hub_cache, "org/tiny", files_of(hf_checkpoint), A, refs=("main", "v1"))
    second = put_snapshot(
        hub_cache, "org/tiny", {"config.json": hf_checkpoint / "config.json"}, B, refs=("dev",)
    )
    source = hub.resolve_checkpoint("org/tiny")
    assert (source.repo_id, source.repo_type, source.revision, source.commit) == (
        "org/tiny",
        "model",
        "main",
        A,
    )
    assert source.path == first and (source.path / "model.safetensors").is_file()
    assert hub.resolve_checkpoint("org/tiny@v1").commit == A
    assert hub.resolve_checkpoint(f"org/tiny@{A}").path == first
    # a config alone is what an estimate needs; a run needs the weights, which this snapshot lacks
    assert hub.resolve_checkpoint("org/tiny@dev", weights=False).path == second
    assert hub.resolve_checkpoint(f"org/tiny@{B}", weights=False).commit == B
    with pytest.raises(CheckpointError, match="lacks model.safetensors"):
        hub.resolve_checkpoint("org/tiny@dev")
    assert source.record() == {
        "repo_id": "org/tiny",
        "repo_type": "model",
        "revision": "main",
        "commit": A,
        "path": str(first),
        "files": [],
    }
    assert hub.HubSource.from_record(source.record()) == source


@pytest.mark.slow  # trains twice: the slow tier
def test_finetune_records_the_commit_and_a_resume_reads_it_after_main_moved(
    hub_cache, hf_checkpoint, tmp_path, capsys
):
    first = put_snapshot(hub_cache, "org/tiny", files_of(hf_checkpoint), A)
    out = tmp_path / "run"
    capsys.readouterr()
    assert main(["finetune", *lora_overrides("org/tiny", out)]) == 0
    printed = capsys.readouterr().out
    assert f"model org/tiny@main (hub commit {A[:12]} -> '{first}'; " in printed
    record = {
        "repo_id": "org/tiny",
        "repo_type": "model",
        "revision": "main",
        "commit": A,
        "path": str(first),
    }
    assert hub_record(out) == {"checkpoint_dir": {**record, "files": []}}
    assert saved_config(out)["checkpoint_dir"] == str(first)

    # main moves to a commit whose weights differ (a LoRA base that changed would be refused at resume)
    moved = files_of(hf_checkpoint)
    weights = load_file(str(hf_checkpoint / "model.safetensors"))
    weights["model.norm.weight"] = weights["model.norm.weight"] * 2
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    moved["model.safetensors"] = tmp_path / "model.safetensors"
    put_snapshot(hub_cache, "org/tiny", moved, B)
    assert hub.resolve_checkpoint("org/tiny").commit == B

    assert main(["finetune", *lora_overrides("org/tiny", out, max_steps=4, resume=True)]) == 0
    captured = capsys.readouterr()
    assert (
        f"checkpoint_dir: resuming on hub org/tiny at commit {A[:12]}, the commit the run started from"
        in (captured.out + captured.err)
    )
    assert "resuming at step 2" in captured.out
    assert latest_checkpoint(out).name == "step_00000004"
    assert hub_record(out) == {"checkpoint_dir": {**record, "files": []}}
    # a new run reads main as it is now
    assert main(["finetune", *lora_overrides("org/tiny", tmp_path / "new")]) == 0
    assert hub_record(tmp_path / "new")["checkpoint_dir"]["commit"] == B


def test_a_local_directory_wins_over_the_hub_id_of_its_name(
    hub_cache, hf_checkpoint, tmp_path, monkeypatch, capsys
):
    put_snapshot(hub_cache, "org/tiny", {"config.json": hf_checkpoint / "config.json"}, A)  # never read
    shutil.copytree(hf_checkpoint, tmp_path / "org" / "tiny")
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert main(["finetune", *lora_overrides("org/tiny", tmp_path / "run")]) == 0
    local = tmp_path / "org" / "tiny"
    assert f"model {local} (local directory; " in capsys.readouterr().out
    assert hub_record(tmp_path / "run") is None
    assert saved_config(tmp_path / "run")["checkpoint_dir"] == str(local)


def test_what_the_cache_lacks_is_one_paragraph_before_anything_is_allocated(
    hub_cache, hf_checkpoint, tmp_path, capsys
):
    config_only = put_snapshot(hub_cache, "org/tiny", {"config.json": hf_checkpoint / "config.json"}, A)
    cases = {
        "org/tiny": (
            f"memfit: error: checkpoint_dir: the cached snapshot of Hub model org/tiny at commit {A[:12]} "
            f"('{config_only}') lacks model.safetensors (or model.safetensors.index.json and its shards) (a cache "
            f"filled by memfit estimate or plan holds the config alone), and the Hub was not asked (HF_HUB_OFFLINE=1, "
            f"or it could not be reached): run once with network access to fetch the weights, or point HF_HUB_CACHE "
            f"(or HF_HOME) at a cache that holds them\n"
        ),
        "org/absent": (
            f"memfit: error: checkpoint_dir 'org/absent': no local path of that name exists, and "
            f"Hub model org/absent@main "
            f"is not in the Hugging Face cache ('{hub_cache}'), or not whole, and HF_HUB_OFFLINE=1 is set: run once "
            f"with network access to fetch it (HF_HUB_OFFLINE unset), or point HF_HUB_CACHE (or HF_HOME) at a cache "
            f"that holds it. Nothing was downloaded or allocated\n"
        ),
        "org/tiny@v9": (
            f"memfit: error: checkpoint_dir 'org/tiny@v9': no local path of that name exists, and "
            f"Hub model org/tiny@v9 "
            f"is not in the Hugging Face cache ('{hub_cache}'), or not whole, and HF_HUB_OFFLINE=1 is set: run once "
            f"with network access to fetch it (HF_HUB_OFFLINE unset), or point HF_HUB_CACHE (or HF_HOME) at a cache "
            f"that holds it. Nothing was downloaded or allocated\n"
        ),
    }
    for spec, message in cases.items():
        capsys.readouterr()
        assert main(["finetune", *lora_overrides(spec, tmp_path / "run")]) == 1
        assert capsys.readouterr().err == message
        assert not (tmp_path / "run").exists()


def _http_error(cls, status: int, url: str):
    response = httpx2.Response(status, request=httpx2.Request("GET", url))
    return cls(f"{status} Client Error. (Request ID: test)", response=response)


@pytest.mark.parametrize(
    "raised, message",
    [
        (
            lambda: _http_error(GatedRepoError, 403, "https://huggingface.co/api/models/org/gated"),
            "Hub model org/gated is gated and this machine has no access to it: accept its conditions at "
            "https://huggingface.co/org/gated with your account, then give your token (HF_TOKEN=hf_... in the "
            "environment, or `hf auth login`); or, where a filled Hugging Face cache holds it, run with "
            "HF_HUB_OFFLINE=1. Nothing was downloaded or allocated",
        ),
        (
            lambda: _http_error(RepositoryNotFoundError, 404, "https://huggingface.co/api/models/org/gated"),
            "'org/gated' is neither a local path nor a model repository the Hub shows this machine (not found, or "
            "private): check the spelling (ORG/NAME, or a path that exists); a private repository needs your token "
            "(HF_TOKEN=hf_... or `hf auth login`); or, where a filled Hugging Face cache holds it, run with "
            "HF_HUB_OFFLINE=1. Nothing was downloaded or allocated",
        ),
        (
            lambda: _http_error(
                RevisionNotFoundError, 404, "https://huggingface.co/api/models/org/gated/revision/main"
            ),
            "Hub model org/gated has no revision 'main' (a branch, a tag or a commit sha; see "
            "https://huggingface.co/org/gated/tree/main); fix the part after '@'. Nothing was downloaded or allocated",
        ),
    ],
)
def test_hub_refusals_are_one_paragraph(
    hub_cache, hf_checkpoint, tmp_path, monkeypatch, capsys, raised, message
):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    calls = []

    def download(repo_id, **kwargs):
        calls.append(kwargs)
        raise raised()

    monkeypatch.setattr("huggingface_hub.snapshot_download", download)
    capsys.readouterr()
    assert main(["finetune", *lora_overrides("org/gated", tmp_path / "run")]) == 1
    assert capsys.readouterr().err == f"memfit: error: checkpoint_dir 'org/gated': {message}\n"
    assert len(calls) == 1 and calls[0]["dry_run"] is True  # refused at the listing: nothing was fetched
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------------------------------------------
# Fetching: only what memfit reads, after checking the disk


REPO_FILES = {  # a model repo as the Hub lists it: path -> bytes
    "config.json": 700,
    "generation_config.json": 120,
    "model.safetensors": 3_000_000,
    "tokenizer.json": 40_000,
    "tokenizer_config.json": 900,
    "special_tokens_map.json": 300,
    "chat_template.jinja": 1_000,
    "README.md": 5_000,
    "pytorch_model.bin": 3_000_000,
    "model.gguf": 2_000_000,
    "original/consolidated.00.pth": 3_000_000,
    "original/tokenizer.model": 2_000_000,
    "onnx/model.onnx": 3_000_000,
}


def fake_hub(monkeypatch, cache: Path, source: Path, calls: list[dict]):
    """huggingface_hub's snapshot_download as the Hub would answer for REPO_FILES at commit A: a dry run lists what
    the patterns select (huggingface_hub's own filter) with sizes; a download puts the selected files of ``source``
    (or empty files) into the cache."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    def download(
        repo_id, *, revision=None, allow_patterns=None, ignore_patterns=None, dry_run=False, **kwargs
    ):
        calls.append(
            {"revision": revision, "allow": allow_patterns, "ignore": ignore_patterns, "dry_run": dry_run}
        )
        chosen = list(
            filter_repo_objects(REPO_FILES, allow_patterns=allow_patterns, ignore_patterns=ignore_patterns)
        )
        if dry_run:
            return [DryRunFileInfo(A, REPO_FILES[n], n, "", False, True) for n in chosen]
        files = {n: (source / n if (source / n).is_file() else b"") for n in chosen}
        return str(put_snapshot(cache, repo_id, files, A))

    monkeypatch.setattr("huggingface_hub.snapshot_download", download)


def test_a_download_fetches_only_what_memfit_reads_after_checking_the_disk(
    hub_cache, hf_checkpoint, monkeypatch
):
    calls: list[dict] = []
    fake_hub(monkeypatch, hub_cache, hf_checkpoint, calls)
    said = []
    monkeypatch.setattr(
        hub.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9, 2_000_000)
    )
    with pytest.raises(CheckpointError) as refused:
        hub.resolve_checkpoint("org/tiny", say=said.append)
    need = 700 + 120 + 3_000_000 + 40_000 + 900 + 300 + 1_000
    assert str(refused.value) == (
        f"checkpoint_dir: fetching 7 file(s) of Hub model org/tiny@main needs 2.90 MiB, but the cache's disk "
        f"('{hub_cache}') has 1.91 MiB free; free some space, or point HF_HUB_CACHE (or HF_HOME) at a larger disk. "
        f"Nothing was downloaded"
    )
    assert need == 3_043_020 and [c["dry_run"] for c in calls] == [True]
    assert not any(hub_cache.iterdir())

    monkeypatch.setattr(hub.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 0, 10**9))
    source = hub.resolve_checkpoint("org/tiny", say=said.append)
    assert said == [
        f"fetching 7 file(s), 2.90 MiB, of Hub model org/tiny@main (commit {A[:12]}) into '{hub_cache}'"
    ]
    assert calls[-1]["revision"] == A and not calls[-1]["dry_run"]  # the listed commit, not main again
    assert sorted(f.name for f in source.path.iterdir()) == [
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    # an estimate asks for the config (and the shards' index) alone
    calls.clear()
    hub.resolve_checkpoint("org/tiny", weights=False, say=said.append)
    assert {tuple(c["allow"]) for c in calls} == {("config.json", "model.safetensors.index.json")}


# ----------------------------------------------------------------------------------------------------------------
# Estimate and plan from a config alone


def test_estimate_from_a_config_alone_equals_the_full_directory(
    hub_cache, hf_checkpoint, monkeypatch, capsys
):
    put_snapshot(hub_cache, "org/tiny", {"config.json": hf_checkpoint / "config.json"}, A)
    asked = []
    real = __import__("huggingface_hub").snapshot_download

    def recorded(repo_id, **kwargs):
        asked.append(kwargs.get("allow_patterns"))
        return real(repo_id, **kwargs)

    monkeypatch.setattr("huggingface_hub.snapshot_download", recorded)
    settings = ["method=qlora", "dtype=bf16", "seq_len=256", "batch_size=2", "device=cpu", "--json"]
    estimates = {}
    for checkpoint in ("org/tiny", str(hf_checkpoint)):
        capsys.readouterr()
        assert main(["estimate", f"checkpoint_dir={checkpoint}", *settings]) == 0
        captured = capsys.readouterr()
        estimates[checkpoint] = json.loads(captured.out)
    assert asked == [["config.json", "model.safetensors.index.json"]]  # never a weight
    assert not list(hub_cache.rglob("*.safetensors"))
    hub_json, local_json = estimates["org/tiny"], estimates[str(hf_checkpoint)]
    assert hub_json["config"].pop("model") == f"org/tiny@main (commit {A[:12]})"
    assert local_json["config"].pop("model") == str(hf_checkpoint)
    for e in (hub_json, local_json):  # the timings and this process's own memory, measured each time
        for key in ("seconds", "host_peak_rss_gib", "process_baseline_gib"):
            e.pop(key)
        phase_rss = e.pop(
            "phase_rss_gib"
        )  # each phase's tensors over this process's memory, measured each time
        assert phase_rss.keys() == e["phase_peaks_gib"].keys()
        e["trace"].pop("trace_seconds")
    assert hub_json == local_json
    assert hub_json["phase_peaks_gib"]["load"] > 0  # the load is predicted from the config's tensors


# ----------------------------------------------------------------------------------------------------------------
# Datasets


def read_losses(out: Path) -> list[float]:
    return [
        r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r
    ]


@pytest.mark.slow  # trains twice: the slow tier
def test_records_from_a_dataset_repo_train_as_the_local_file(hub_cache, hf_checkpoint, tmp_path, capsys):
    snapshot = put_snapshot(
        hub_cache, "org/dolly", {"train.json": DOLLY, "test.json": DOLLY, "README.md": b"# dolly"}, A,
        repo_type="dataset",
    )  # fmt: skip
    settings = {"data.path": "org/dolly", "data.split": "train"}
    capsys.readouterr()
    assert main(["finetune", *lora_overrides(hf_checkpoint, tmp_path / "hub", **settings)]) == 0
    assert f"from hub org/dolly@main (commit {A[:12]}) -> '{snapshot}'" in capsys.readouterr().out
    assert main(["finetune", *lora_overrides(hf_checkpoint, tmp_path / "local")]) == 0
    assert (
        read_losses(tmp_path / "hub") == read_losses(tmp_path / "local")
        and len(read_losses(tmp_path / "hub")) == 2
    )
    assert hub_record(tmp_path / "hub") == {
        "data.path": {
            "repo_id": "org/dolly",
            "repo_type": "dataset",
            "revision": "main",
            "commit": A,
            "path": str(snapshot),
            "files": ["train.json"],
        }
    }
    assert saved_config(tmp_path / "hub")["data"]["path"] == str(snapshot / "train.json")
    # two files selected: records are read from one
    capsys.readouterr()
    assert (
        main(["finetune", *lora_overrides(hf_checkpoint, tmp_path / "two", **{"data.path": "org/dolly"})])
        == 1
    )
    assert capsys.readouterr().err == (
        "memfit: error: data.path 'org/dolly': data.format=dolly reads one .json or .jsonl file of records, and 2 are "
        "selected (test.json, train.json); choose one with data.files (e.g. data.files='test.json') or data.split\n"
    )
    assert not (tmp_path / "two").exists()


def test_a_text_dataset_repo_prepares_as_its_local_files(
    hub_cache, hf_checkpoint, small_corpus, tmp_path, capsys
):
    text = small_corpus.read_text(encoding="utf-8")
    lines = [json.dumps({"text": part}) for part in text.split("\n\n") if part.strip()]
    files = {
        "data/train-00000-of-00002.jsonl": ("\n".join(lines[:200]) + "\n").encode(),
        "data/train-00001-of-00002.jsonl": ("\n".join(lines[200:400]) + "\n").encode(),
        "data/test-00000-of-00001.jsonl": ("\n".join(lines[400:]) + "\n").encode(),
    }
    snapshot = put_snapshot(hub_cache, "org/corpus", files, A, repo_type="dataset")
    local = tmp_path / "local"
    for name, data in files.items():
        (local / name).parent.mkdir(parents=True, exist_ok=True)
        (local / name).write_bytes(data)
    common = ["--tokenizer", str(hf_checkpoint), "--workers", "1", "--quiet"]
    capsys.readouterr()
    assert (
        main(["prepare", "--out", str(tmp_path / "hub"), "--source", "shake=org/corpus:*/train-*", *common])
        == 0
    )
    assert (
        f"--source shake: hub org/corpus@main (commit {A[:12]}) -> '{snapshot}', 2 file(s)"
        in capsys.readouterr().err
    )
    args = ["--source", f"shake={local}/data/train-*"]
    assert main(["prepare", "--out", str(tmp_path / "local_out"), *args, *common]) == 0
    hub_manifest = json.loads((tmp_path / "hub" / "manifest.json").read_text())["sources"]["shake"]
    local_manifest = json.loads((tmp_path / "local_out" / "manifest.json").read_text())["sources"]["shake"]
    assert [f["path"] for f in hub_manifest["files"]] == [
        str(snapshot / "data/train-00000-of-00002.jsonl"),
        str(snapshot / "data/train-00001-of-00002.jsonl"),
    ]
    for m in (hub_manifest, local_manifest):  # where the files are (named in their units and shards) differs
        m["files"] = [
            {k: v for k, v in f.items() if k not in ("path", "mtime_ns", "unit")} for f in m["files"]
        ]
        m["shards"] = [{k: v for k, v in sh.items() if k != "file"} for sh in m["shards"]]
    assert hub_manifest == local_manifest and hub_manifest["documents"] == 400

    # a run's data.path: one source named after the repo, of the files data.split selects
    from memfit.data.run import _raw_sources

    assert _raw_sources(str(snapshot), None, "test") == {
        "corpus": [str(snapshot / "data/test-00000-of-00001.jsonl")]
    }
    assert _raw_sources(str(snapshot)) == {"corpus": [str(snapshot / name) for name in sorted(files)]}


def test_plan_from_a_config_alone_writes_the_hub_id(hub_cache, hf_checkpoint, tmp_path, capsys):
    put_snapshot(hub_cache, "org/tiny", {"config.json": hf_checkpoint / "config.json"}, A)
    out = tmp_path / "plan.yaml"
    args = [
        "checkpoint_dir=org/tiny",
        "method=lora",
        "budget=2GiB",
        "batch_size=1",
        "seq_len=64",
        "device=cpu",
    ]
    capsys.readouterr()
    assert main(["plan", *args, "dtype=fp32", "--optimizers", "adamw", "--out", str(out)]) == 0
    assert f"checkpoint_dir: hub org/tiny@main (commit {A[:12]}) -> " in capsys.readouterr().err
    planned = yaml.safe_load(out.read_text())
    assert (planned["checkpoint_dir"], planned["method"], planned["optimizer"]["name"]) == (
        "org/tiny",
        "lora",
        "adamw",
    )
    assert not list(hub_cache.rglob("*.safetensors"))  # the run fetches the weights when it starts
