"""memfit's preference objectives equal TRL 1.13's own, on the same pairs and weights, in fp32.

TRL runs through :mod:`tests.trl_reference` (its ``DPOTrainer``, ``CPOTrainer`` and ``ORPOTrainer`` code paths on a
tiny Llama / Qwen2 chat checkpoint with the family's real chat template); memfit through its own data preparation
(:func:`~memfit.data.preference.prepare_preference` with the checkpoint's template), loader
(:func:`~memfit.convert.load_pretrained`) and step functions (:func:`~memfit.step.sequence_logps`,
:func:`~memfit.step.preference_micro_batch_loss`, :func:`~memfit.objectives.metrics_from_sums`, and
:func:`~memfit.step.train_step` itself). Compared: the rows and completion masks, the reference's and the
policy's log-probabilities, the loss, TRL's metrics and every parameter's gradient by name.

- DPO (``sigmoid``) and IPO: ``trl_dpo`` on conversational records (system messages, multi-turn prompts), the
  reference a perturbed copy of the policy (so the loss is not ln 2), plain and with ``chunked_cross_entropy=3``.
- SimPO (``cpo_alpha`` and ``label_smoothing`` > 0) and ORPO: ``trl_cpo`` / ``trl_orpo`` on memfit's own batch,
  given to TRL as the ``(2B, T + 1)`` rows it was cut from (:func:`full_rows`).
- LoRA DPO: ``trl_dpo`` with PEFT adapters (non-zero ``lora_B``), the reference the adapters-off base; memfit with
  :func:`~memfit.models.peft.apply_lora` and the same adapter values, its reference under
  :func:`~memfit.models.peft.lora_off`.
- The same through :func:`~memfit.step.train_step` (``reference="model"``, ``"lora_off"``, none), whose step
  totals (pairs, the tokens the NLL term averages over) are its own.

Plain-string records are left out: memfit renders them through the chat template as a one-turn chat, TRL as plain
text with EOS appended (:mod:`memfit.data.preference`), so they are not the same rows by design. memfit pads Qwen's
rows with ``<|im_end|>`` (its EOS: :func:`memfit.data.instruct.pad_token_id` does not read ``pad_token`` from
``tokenizer_config.json``), TRL with ``<|endoftext|>``; padding is never attended to or scored, so only the rows'
real tokens are compared.

The fast tier runs the Llama row check and DPO case (about 10 s with the imports); the rest is in the slow tier.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from memfit.convert import checkpoint_tokenizer, load_pretrained
from memfit.data.preference import prepare_preference
from memfit.data.templates import resolve_template
from memfit.memory.techniques import IGNORE_INDEX
from memfit.models.peft import apply_lora, lora_off
from memfit.objectives import PAIR_METRICS, Preference, StepNorms, metrics_from_sums, whole_targets
from memfit.step import PreferenceStep, preference_micro_batch_loss, sequence_logps, train_step

from .trl_reference import tiny_chat_checkpoint, trl_cpo, trl_dpo, trl_orpo

pytestmark = pytest.mark.usefixtures("one_thread")

ATOL = 1e-5
"""Absolute tolerance of every compared number (loss, metrics, gradients), fp32."""
LOGPS_RTOL = 1e-6
"""And relative, for summed log-probabilities of whole replies (and their means, ``logps/*``): they are -40 to -180
here, where fp32's spacing is 1.5e-5 (128 to 256), so sums in another order differ by more than :data:`ATOL`;
1e-6 of 160 is about 10 such steps (2 seen)."""

DPO_BETA = 0.1
IPO_BETA = 0.5
ORPO_BETA = 0.25
SIMPO = Preference("simpo", beta=2.0, label_smoothing=0.1, simpo_gamma=0.5, cpo_alpha=0.3)
LORA = {"rank": 4, "alpha": 8, "target_modules": ("q_proj", "v_proj")}
ORPO_METRICS = (*PAIR_METRICS, "nll_loss", "log_odds_ratio", "log_odds_chosen")

RECORDS = [
    {
        "prompt": [
            {"role": "system", "content": "You answer in one short line."},
            {"role": "user", "content": "Who is the king in Hamlet?"},
        ],
        "chosen": [{"role": "assistant", "content": "Claudius, Hamlet's uncle."}],
        "rejected": [{"role": "assistant", "content": "Nobody."}],
    },
    {
        "prompt": [
            {"role": "user", "content": "Name a river."},
            {"role": "assistant", "content": "The Thames."},
            {"role": "user", "content": "And another one?"},
        ],
        "chosen": [{"role": "assistant", "content": "The Avon, which flows through Stratford."}],
        "rejected": [{"role": "assistant", "content": "The Thames again."}],
    },
    {
        "prompt": [{"role": "user", "content": "Say something kind."}],
        "chosen": [{"role": "assistant", "content": "Thou art more lovely and more temperate."}],
        "rejected": [{"role": "assistant", "content": "Go away, thou knave, and trouble me no more today."}],
    },
    {
        "prompt": [
            {"role": "system", "content": "Be helpful."},
            {"role": "user", "content": "Is it raining?"},
            {"role": "assistant", "content": "I cannot see outside."},
            {"role": "user", "content": "Guess."},
        ],
        "chosen": [{"role": "assistant", "content": "Probably not."}],
        "rejected": [{"role": "assistant", "content": "Yes, it is raining frogs in London."}],
    },
]
"""Conversational pairs (TRL's format): system messages, multi-turn prompts, chosen replies shorter and longer than
the rejected ones (so both halves of the batch have padding)."""


# ----------------------------------------------------------------------------------------------------------------
# helpers


def perturbed_copy(src: Path, dst: Path, *, scale: float = 0.05, seed: int = 1) -> Path:
    """A copy of checkpoint ``src`` at ``dst`` with ``scale * N(0, 1)`` added to every weight (the reference)."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    generator = torch.Generator().manual_seed(seed)
    noisy = {k: v + scale * torch.randn(v.shape, generator=generator) for k, v in sorted(tensors.items())}
    save_file(noisy, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def full_rows(
    inputs: torch.Tensor, targets: torch.Tensor, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``(2B, T + 1)`` token rows a memfit preference batch was cut from, in TRL's unshifted convention.

    memfit's row is ``inputs = ids[:-1]``, ``targets = labels[1:]`` (position ``t`` predicts ``targets[t]``); TRL
    takes ``ids`` and ``labels`` and shifts inside (``labels[t + 1]`` is predicted from position ``t``). A row's
    last token is in ``targets`` only (a row ends with its reply), so it is put back from there.

    Args:
        inputs: ``(2B, T)`` ids, right-padded with ``pad_id``.
        targets: ``(2B, T)``, ``-100`` outside the replies.
        pad_id: The padding id.

    Returns:
        ``(ids, labels, attention_mask)``, each ``(2B, T + 1)`` int64: the rows right-padded with ``pad_id``, the
        reply tokens' ids (``-100`` elsewhere), 1 on the rows' tokens.
    """
    R, T = inputs.shape
    counted = targets != IGNORE_INDEX  # (2B, T)
    last = T - 1 - counted.flip(1).int().argmax(dim=1)  # (2B,): each row's last reply target
    # a row is its last target's position + 2 tokens long
    mask = (torch.arange(T + 1) < (last + 2)[:, None]).long()  # (2B, T + 1)
    ids = torch.cat([inputs, torch.full((R, 1), pad_id)], dim=1)  # (2B, T + 1)
    ids[:, 1:] = torch.where(counted, targets, ids[:, 1:])
    ids = torch.where(mask.bool(), ids, pad_id)
    # the targets are the next inputs, and nothing but padding follows a row's inputs (one token fewer than ids)
    assert torch.equal(torch.where(mask[:, 1:].bool(), ids[:, :T], pad_id), inputs)
    labels = torch.cat([torch.full((R, 1), IGNORE_INDEX), targets], dim=1)  # (2B, T + 1)
    return ids, labels, mask


def trl_norms(inputs: torch.Tensor, targets: torch.Tensor, pref: Preference) -> StepNorms:
    """A one-micro-batch step's totals as TRL counts them: the pairs, and the chosen rows' targets of the NLL term
    (the replies', or for ORPO every next token of prompt and reply)."""
    B = targets.shape[0] // 2
    counted = whole_targets(inputs, targets) if pref.nll_covers_prompt else targets  # (2B, T)
    return StepNorms(pairs=torch.tensor(float(B)), chosen_tokens=(counted[:B] != IGNORE_INDEX).sum().float())


def memfit_objective(
    model: torch.nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    reference: torch.Tensor | None,
    pref: Preference,
    *,
    chunked_cross_entropy: int = 0,
) -> tuple[float, dict[str, float]]:
    """memfit's loss (backpropagated into ``model``'s gradients) and metrics of a step of one micro-batch."""
    norms = trl_norms(inputs, targets, pref)
    model.zero_grad(set_to_none=True)
    loss, sums = preference_micro_batch_loss(
        model,
        inputs,
        targets,
        reference,
        pref,
        norms,
        dtype="fp32",
        chunked_cross_entropy=chunked_cross_entropy,
    )
    loss.backward()
    return float(loss.detach()), {k: float(v) for k, v in metrics_from_sums(pref, sums, norms).items()}


class KeepGrads(torch.optim.SGD):
    """A learning rate 0 update that keeps the gradients :func:`train_step` hands it (the step frees them after),
    by parameter name."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.names = {p: n for n, p in model.named_parameters() if p.requires_grad}
        super().__init__(list(self.names), lr=0.0)
        self.grads: dict[str, torch.Tensor] = {}

    def step(self, closure=None):
        self.grads = {n: p.grad.clone() for p, n in self.names.items() if p.grad is not None}
        return super().step(closure)


def assert_close(what: str, mine: dict, theirs: dict, *, atol: float = ATOL, rtol: float = 0.0) -> None:
    """Each of ``mine`` within ``atol + rtol * |theirs|`` of ``theirs``, name by name (the same names and shapes)."""
    assert sorted(mine) == sorted(theirs), f"{what}: names differ: {sorted(set(mine) ^ set(theirs))}"
    worst = (0.0, "")
    for name, value in mine.items():
        a, b = torch.as_tensor(value).float(), torch.as_tensor(theirs[name]).float()
        assert a.shape == b.shape, f"{what}: {name} is {tuple(a.shape)} here, {tuple(b.shape)} in TRL"
        excess = float(((a - b).abs() - rtol * b.abs()).max())
        worst = max(worst, (excess, name))
    assert worst[0] <= atol, f"{what}: {worst[1]} differs by {worst[0]:.3g} (> {atol:g} + {rtol:g} * |TRL's|)"


def assert_logps(what: str, logps: torch.Tensor, chosen: torch.Tensor, rejected: torch.Tensor) -> None:
    """``logps`` (2B,) are TRL's ``chosen`` (B,) then ``rejected`` (B,)."""
    B = len(chosen)
    mine = {"chosen": logps[:B], "rejected": logps[B:]}
    assert_close(what, mine, {"chosen": chosen, "rejected": rejected}, rtol=LOGPS_RTOL)


def assert_step(
    trl: dict,
    loss: float,
    metrics: dict[str, float],
    grads: dict[str, torch.Tensor],
    names: tuple[str, ...] = PAIR_METRICS,
) -> None:
    """memfit's loss, metrics ``names`` (``logps/*``, means of summed log-probabilities, to :data:`LOGPS_RTOL`)
    and gradients are TRL's."""
    assert abs(loss - trl["loss"]) <= ATOL, f"loss {loss} here, {trl['loss']} in TRL"
    for what, keys, rtol in (
        ("metrics", [k for k in names if not k.startswith("logps/")], 0.0),
        ("logps metrics", [k for k in names if k.startswith("logps/")], LOGPS_RTOL),
    ):
        assert_close(what, {k: metrics[k] for k in keys}, {k: trl["metrics"][k] for k in keys}, rtol=rtol)
    assert_close("gradients", grads, trl["grads"])


def grads_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def peft_names(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """memfit's LoRA parameter names (``model.layers.0.self_attn.q_proj.lora_A``) as PEFT's."""
    return {f"base_model.model.{n}.default.weight": g for n, g in grads.items()}


# ----------------------------------------------------------------------------------------------------------------
# each family's checkpoints, memfit's batch and TRL's runs, made once per module


class Family:
    """One family's checkpoints (policy, perturbed reference), memfit's rendering of :data:`RECORDS` as one batch,
    and TRL's runs (each made on first use)."""

    def __init__(self, name: str, root: Path) -> None:
        self.name, self.root = name, root
        self.policy = tiny_chat_checkpoint(root / "policy", name)
        self.reference = perturbed_copy(self.policy, root / "reference")
        data = root / "pairs.json"
        data.write_text(json.dumps(RECORDS), encoding="utf-8")
        tokenizer = checkpoint_tokenizer(self.policy)
        prepared = prepare_preference(
            data, resolve_template("auto", tokenizer), tokenizer, max_seq_len=4096, val_fraction=0.0, seed=0
        )
        assert len(prepared.train) == len(RECORDS), prepared.stats
        assert prepared.stats.num_prefix_mismatch == prepared.stats.num_truncated == 0, prepared.stats
        self.pad_id = prepared.train.pad_id
        self.inputs, self.targets, index = prepared.train.collate(range(len(RECORDS)))  # (2B, T) each
        assert index.tolist() == list(range(len(RECORDS)))  # file order: TRL's sequential batch
        self.rows = full_rows(self.inputs, self.targets, self.pad_id)  # (2B, T + 1) each, for CPO and ORPO
        self._trl: dict[tuple, dict] = {}

    def model(self, which: str = "policy") -> torch.nn.Module:
        """memfit's model of the policy (or the reference), fp32."""
        path = self.policy if which == "policy" else self.reference
        return load_pretrained(path, dtype=torch.float32)[0]

    def lora_model(self) -> torch.nn.Module:
        """The policy with :data:`LORA` adapters, ``lora_B`` drawn non-zero (so that it is not the reference)."""
        model = self.model()
        names = apply_lora(model, dropout=0.0, seed=0, **LORA)
        params, generator = dict(model.named_parameters()), torch.Generator().manual_seed(2)
        with torch.no_grad():
            for name in names:
                if name.endswith(".lora_B"):
                    params[name].copy_(0.1 * torch.randn(params[name].shape, generator=generator))
        return model

    def trl(self, what: str, **kwargs) -> dict:
        """TRL's run ``what`` (``dpo``, ``lora_dpo``, ``simpo``, ``orpo``) with ``kwargs``, made once."""
        key = (what, *sorted(kwargs.items()))
        if key not in self._trl:
            workdir = self.root / f"trl_{len(self._trl)}"
            if what == "dpo":
                run = trl_dpo(self.policy, RECORDS, ref_checkpoint=self.reference, workdir=workdir, **kwargs)
            elif what == "lora_dpo":
                run = self._trl_lora_dpo(workdir, **kwargs)
            elif what == "simpo":
                run = trl_cpo(
                    self.policy, *self.rows[:2], attention_mask=self.rows[2], workdir=workdir, **kwargs
                )
            else:
                run = trl_orpo(
                    self.policy, *self.rows[:2], attention_mask=self.rows[2], workdir=workdir, **kwargs
                )
            self._trl[key] = run
        return self._trl[key]

    def _trl_lora_dpo(self, workdir: Path, beta: float) -> dict:
        from peft import LoraConfig

        adapters = {n: p.detach() for n, p in self.lora_model().named_parameters() if ".lora_" in n}
        config = LoraConfig(
            r=LORA["rank"],
            lora_alpha=LORA["alpha"],
            lora_dropout=0.0,
            target_modules=list(LORA["target_modules"]),
            task_type="CAUSAL_LM",
        )
        # an adapter file's names: base_model.model.<memfit's name>.weight
        state = {f"base_model.model.{n}.weight": v for n, v in adapters.items()}
        return trl_dpo(
            self.policy, RECORDS, beta=beta, peft_config=config, adapter_state=state, workdir=workdir
        )


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """``families(name)``: that :class:`Family`, made once per module."""
    made: dict[str, Family] = {}

    def get(name: str) -> Family:
        if name not in made:
            made[name] = Family(name, tmp_path_factory.mktemp(f"trl_{name}"))
        return made[name]

    return get


# ----------------------------------------------------------------------------------------------------------------
# the rows


@pytest.mark.parametrize("family", ["llama", pytest.param("qwen2", marks=pytest.mark.slow)])
def test_rows_equal_trl(families, family):
    """memfit's rows are TRL's: the same tokens and attention mask, memfit's counted targets at the positions of
    TRL's completion mask shifted by one, each the token that follows."""
    f = families(family)
    trl = f.trl("dpo", loss_type="sigmoid", beta=DPO_BETA)
    assert trl["trl_warnings"] == []
    ids, labels, mask = f.rows
    assert torch.equal(mask, trl["attention_mask"])
    real = mask.bool()
    assert torch.equal(ids[real], trl["input_ids"][real])
    assert torch.equal(labels != IGNORE_INDEX, trl["completion_mask"].bool())
    # (2B, T): the positions that predict a completion token
    completion = trl["completion_mask"][:, 1:].bool()
    assert torch.equal(f.targets != IGNORE_INDEX, completion)
    assert torch.equal(f.targets[completion], trl["input_ids"][:, 1:][completion])
    B = len(RECORDS)
    assert not mask[:B].all() and not mask[B:].all()  # padding in both halves


# ----------------------------------------------------------------------------------------------------------------
# DPO and IPO through DPOTrainer


DPO_CASES = [
    pytest.param("llama", "sigmoid", 0, id="llama-dpo"),
    pytest.param("llama", "sigmoid", 3, id="llama-dpo-chunked", marks=pytest.mark.slow),
    pytest.param("llama", "ipo", 0, id="llama-ipo", marks=pytest.mark.slow),
    pytest.param("llama", "ipo", 3, id="llama-ipo-chunked", marks=pytest.mark.slow),
    pytest.param("qwen2", "sigmoid", 0, id="qwen2-dpo", marks=pytest.mark.slow),
    pytest.param("qwen2", "sigmoid", 3, id="qwen2-dpo-chunked", marks=pytest.mark.slow),
    pytest.param("qwen2", "ipo", 0, id="qwen2-ipo", marks=pytest.mark.slow),
    pytest.param("qwen2", "ipo", 3, id="qwen2-ipo-chunked", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("family", "loss_type", "chunks"), DPO_CASES)
def test_dpo_matches_trl(families, family, loss_type, chunks):
    """DPO / IPO against a separate reference model: the reference's and the policy's log-probabilities, the loss,
    the metrics and every gradient."""
    f = families(family)
    objective, beta = ("dpo", DPO_BETA) if loss_type == "sigmoid" else ("ipo", IPO_BETA)
    trl = f.trl("dpo", loss_type=loss_type, beta=beta)
    reference = sequence_logps(
        f.model("reference"), f.inputs, f.targets, dtype="fp32", chunked_cross_entropy=chunks
    )  # (2B,)
    assert_logps("reference logps", reference, trl["ref_chosen_logps"], trl["ref_rejected_logps"])
    model = f.model()
    policy = sequence_logps(model, f.inputs, f.targets, dtype="fp32", chunked_cross_entropy=chunks)
    assert_logps("policy logps", policy, trl["chosen_logps"], trl["rejected_logps"])
    pref = Preference(objective, beta=beta)
    loss, metrics = memfit_objective(
        model, f.inputs, f.targets, reference, pref, chunked_cross_entropy=chunks
    )
    assert_step(trl, loss, metrics, grads_of(model))
    assert abs(metrics["rewards/margins"]) > 0.01  # the reference is not the policy


# ----------------------------------------------------------------------------------------------------------------
# SimPO and ORPO on memfit's batch


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_simpo_matches_trl(families, family):
    """SimPO with the chosen replies' cross-entropy (``cpo_alpha``) and label smoothing against ``CPOTrainer``."""
    f = families(family)
    trl = f.trl(
        "simpo",
        loss_type="simpo",
        beta=SIMPO.beta,
        simpo_gamma=SIMPO.simpo_gamma,
        cpo_alpha=SIMPO.cpo_alpha,
        label_smoothing=SIMPO.label_smoothing,
    )
    model = f.model()
    loss, metrics = memfit_objective(model, f.inputs, f.targets, None, SIMPO)
    assert_step(trl, loss, metrics, grads_of(model), (*PAIR_METRICS, "nll_loss"))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_orpo_matches_trl(families, family):
    """ORPO against ``ORPOTrainer``, its NLL the chosen rows' mean over prompt and reply tokens (TRL's count)."""
    f = families(family)
    trl = f.trl("orpo", beta=ORPO_BETA)
    model = f.model()
    loss, metrics = memfit_objective(model, f.inputs, f.targets, None, Preference("orpo", beta=ORPO_BETA))
    assert_step(trl, loss, metrics, grads_of(model), ORPO_METRICS)


# ----------------------------------------------------------------------------------------------------------------
# LoRA DPO: the reference is the policy with its adapters off


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_lora_dpo_matches_trl(families, family):
    """DPO of a LoRA policy (PEFT in TRL, :func:`apply_lora` in memfit) with the same adapter values."""
    f = families(family)
    trl = f.trl("lora_dpo", beta=DPO_BETA)
    assert trl["trl_warnings"] == []
    model = f.lora_model()
    with lora_off():
        reference = sequence_logps(model, f.inputs, f.targets, dtype="fp32")
    assert_logps("reference logps", reference, trl["ref_chosen_logps"], trl["ref_rejected_logps"])
    policy = sequence_logps(model, f.inputs, f.targets, dtype="fp32")
    assert_logps("policy logps", policy, trl["chosen_logps"], trl["rejected_logps"])
    loss, metrics = memfit_objective(model, f.inputs, f.targets, reference, Preference("dpo", beta=DPO_BETA))
    grads = grads_of(model)
    assert sorted(grads) == sorted(n for n, _ in model.named_parameters() if ".lora_" in n)
    assert_step(trl, loss, metrics, peft_names(grads))
    assert abs(metrics["rewards/margins"]) > 0.01  # the adapters change the policy


# ----------------------------------------------------------------------------------------------------------------
# the same through train_step, with its own step totals and references


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    [
        "dpo",
        "lora_dpo",
        "simpo",
        "orpo",
    ],
)
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_train_step_matches_trl(families, family, case):
    """:func:`train_step` (one micro-batch; learning rate 0) gives TRL's loss, metrics and gradients, with the
    reference from ``reference_model``, from the policy with its LoRA off, or none."""
    f = families(family)
    if case == "dpo":
        trl = f.trl("dpo", loss_type="sigmoid", beta=DPO_BETA)
        model = f.model()
        step = PreferenceStep(Preference("dpo", beta=DPO_BETA), "model", f.model("reference"))
    elif case == "lora_dpo":
        trl = f.trl("lora_dpo", beta=DPO_BETA)
        model = f.lora_model()
        step = PreferenceStep(Preference("dpo", beta=DPO_BETA), "lora_off")
    elif case == "simpo":
        trl = f.trl(
            "simpo",
            loss_type="simpo",
            beta=SIMPO.beta,
            simpo_gamma=SIMPO.simpo_gamma,
            cpo_alpha=SIMPO.cpo_alpha,
            label_smoothing=SIMPO.label_smoothing,
        )
        model, step = f.model(), PreferenceStep(SIMPO)
    else:
        trl = f.trl("orpo", beta=ORPO_BETA)
        model, step = f.model(), PreferenceStep(Preference("orpo", beta=ORPO_BETA))
    optimizer = KeepGrads(model)
    result = train_step(
        model, optimizer, [(f.inputs, f.targets, None)], max_grad_norm=0.0, dtype="fp32", preference=step
    )
    metrics = {k: float(v) for k, v in result.metrics.items()}
    grads = peft_names(optimizer.grads) if case == "lora_dpo" else optimizer.grads
    assert_step(trl, float(result.loss), metrics, grads, tuple(metrics))
