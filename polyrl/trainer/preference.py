"""The DPO and reward-model trainers behind ``polyrl dpo`` and ``polyrl rm``.

Both train on preference pairs (:mod:`polyrl.trainer.preference_data`) on the model engine and
differ only in the model and the loss (:mod:`polyrl.trainer.preference_losses`):

* **DPO** trains the causal LM with ``dpo.loss_type`` (``sigmoid``, ``ipo``, ``simpo``). The
  reference log-probs come from the rows' ``ref_chosen_logps`` / ``ref_rejected_logps`` when every
  row has them, else from a frozen reference engine on ``dpo.ref_model_path`` (default: the
  policy's initial weights); each pair's are computed once, when it is first drawn (or all up
  front with ``dpo.precompute_ref_log_probs``, which then frees the reference model). SimPO
  needs no reference.
* **Reward model** trains a value model (the backbone plus a bias-free scalar head) whose score
  is the head's output at a sequence's last token, with the Bradley-Terry loss; the final model
  is exported as an ``<Arch>ForSequenceClassification`` directory that
  ``transformers.AutoModelForSequenceClassification`` loads.

A run follows :func:`polyrl.trainer.sft.run_sft`: the tiny model when ``model.path`` is empty;
``data.task`` (e.g. ``arithmetic_pairs``) or ``data.train_files`` / ``data.val_files``;
``trainer.total_steps`` steps of ``data.train_batch_size`` pairs drawn by a resumable sampler;
held-out metrics (``val/...``) every ``trainer.test_freq`` steps and at the end; checkpoints
every ``trainer.save_freq`` steps (``trainer.resume_mode=auto`` continues); a PNG of the curves,
``<dpo|rm>_summary.json`` and the Hugging Face export in ``<output_dir>/hf_model``. These trainers
run in one process (world size 1).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from polyrl.config import ConfigError, PolyRLConfig
from polyrl.config.schema import constructor_kwargs
from polyrl.trainer.checkpointing import checkpoint_root
from polyrl.trainer.common import (
    check_devices,
    data_files,
    resolve_model_dir,
    save_run_config,
    with_training_autos,
)
from polyrl.trainer.preference_data import (
    PreferenceDataset,
    TokenizedPair,
    collate_pairs,
    pairs_from_rows,
)
from polyrl.trainer.run_loop import RunLoop, first_and_last
from polyrl.trainer.sft import HF_DIR, engine_configs, restore_sampler

__all__ = ["DEFAULT_PLOT_METRICS", "run_dpo", "run_preference", "run_rm"]

KINDS = ("dpo", "rm")
#: Metrics drawn in ``learning_curves.png`` when ``trainer.plot_metrics`` is empty.
DEFAULT_PLOT_METRICS = {
    "dpo": ("train/loss", "val/loss", "rewards/accuracies", "val/rewards/accuracies"),
    "rm": ("train/loss", "val/loss", "accuracy", "val/accuracy"),
}
#: The held-out accuracy metric of each trainer (in the summary).
ACCURACY = {"dpo": "val/rewards/accuracies", "rm": "val/accuracy"}


def _log(kind: str, message: str) -> None:
    from tqdm import tqdm

    tqdm.write(f"[{kind}] {message}", file=sys.stdout)
    sys.stdout.flush()


def _check_config(cfg: PolyRLConfig, kind: str, max_length: int, has_rows: bool) -> None:
    from polyrl.trainer.tracking import check_trackers

    check_devices(cfg)
    check_trackers(cfg.trainer.loggers)
    opts = getattr(cfg, kind)
    if cfg.trainer.world_size != 1:
        raise ConfigError(
            f"is {cfg.trainer.world_size} (nnodes * n_gpus_per_node), but polyrl {kind} trains "
            "in one process; set trainer.nnodes=1 trainer.n_gpus_per_node=1",
            key="trainer.n_gpus_per_node",
        )
    if cfg.model.lora_rank and kind == "rm":
        # A reward model trains a value head, which LoRA does not adapt: the run would
        # silently train every weight.
        raise ConfigError(
            f"is {cfg.model.lora_rank}, but polyrl rm trains every weight (LoRA is wired into "
            "the RL actor, SFT and DPO); set model.lora_rank=0",
            key="model.lora_rank",
        )
    if not has_rows and not cfg.data.task and not cfg.data.train_files:
        raise ConfigError(
            "no training data: set data.task (e.g. arithmetic_pairs) or data.train_files "
            f"(parquet/jsonl rows with prompt, {opts.chosen_key} and {opts.rejected_key})",
            key="data.train_files",
        )
    if max_length < 2:
        raise ConfigError(f"must be >= 2 tokens, got {max_length}", key=f"{kind}.max_length")
    if opts.dynamic_batching and opts.max_tokens_per_micro_batch < 2 * max_length:
        raise ConfigError(
            f"{opts.max_tokens_per_micro_batch} is below the longest allowed pair (2 x "
            f"{max_length} tokens: both rows of a pair share a micro-batch); raise it to at "
            f"least 2 * {kind}.max_length",
            key=f"{kind}.max_tokens_per_micro_batch",
        )


def _load_pairs(
    cfg: PolyRLConfig,
    kind: str,
    tokenizer: Any,
    max_length: int,
    out_dir: Path,
    train_rows: Sequence[Mapping[str, Any]] | None,
    val_rows: Sequence[Mapping[str, Any]] | None,
) -> tuple[PreferenceDataset, PreferenceDataset | None]:
    from polyrl.data.io import read_rows

    opts = getattr(cfg, kind)
    keys = {
        "prompt_key": cfg.data.prompt_key,
        "chosen_key": opts.chosen_key,
        "rejected_key": opts.rejected_key,
        "margin_key": opts.margin_key if kind == "rm" else "",
    }

    def pairs(rows: Sequence[Mapping[str, Any]], source: str) -> list[dict[str, Any]]:
        return pairs_from_rows(rows, source=source, **keys)

    train_pairs: list[dict[str, Any]] = []
    val_pairs: list[dict[str, Any]] = []
    if train_rows is not None:
        train_pairs = pairs(train_rows, "train_dataset")
        val_files: list[str] = list(cfg.data.val_files)
    else:
        train_files, val_files = data_files(cfg, out_dir)
        for name in train_files:
            train_pairs += pairs(read_rows(name), name)
    if val_rows is not None:
        val_pairs = pairs(val_rows, "eval_dataset")
    else:
        for name in val_files:
            val_pairs += pairs(read_rows(name), name)
    kwargs = {
        "max_length": max_length,
        "truncation": opts.truncation,
        "apply_chat_template_kwargs": cfg.data.apply_chat_template_kwargs,
    }
    train = PreferenceDataset(train_pairs, tokenizer, source="train data", **kwargs)
    val = (
        PreferenceDataset(val_pairs, tokenizer, source="val data", **kwargs) if val_pairs else None
    )
    return train, val


class _AdapterOff:
    """The policy engine with its LoRA adapter disabled: the frozen base model as reference.

    A LoRA run needs no second copy of the base weights for its reference log-probs.
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def infer_batch(self, batch: Any, fn: Any) -> Any:
        """Run ``engine.infer_batch`` on the base model."""
        with self.engine.adapter_disabled():
            return self.engine.infer_batch(batch, fn)

    def close(self) -> None:
        """Nothing to free: the policy engine is closed by its owner."""


class _ReferenceLogProbs:
    """Each pair's reference log-probs (chosen, rejected), from its row or a frozen engine.

    The engine's are computed once per pair, when first needed, and kept.
    """

    def __init__(self, engine: Any, pad_id: int, batch_size: int) -> None:
        self.engine = engine
        self.pad_id = pad_id
        self.batch_size = batch_size
        self._cache: dict[tuple[str, int], tuple[float, float]] = {}

    def get(self, split: str, data: PreferenceDataset, indices: Sequence[int]) -> list[tuple]:
        from polyrl.trainer.preference_losses import completion_log_probs

        missing = []
        for i in indices:
            item = data[i]
            if item.ref_chosen is not None and item.ref_rejected is not None:
                self._cache[(split, i)] = (item.ref_chosen, item.ref_rejected)
            elif (split, i) not in self._cache:
                missing.append(i)
        if missing and self.engine is None:
            raise RuntimeError("reference log-probs are needed but the reference model is gone")
        for start in range(0, len(missing), self.batch_size):
            chunk = missing[start : start + self.batch_size]
            batch = collate_pairs([data[i] for i in chunk], self.pad_id)
            logps = self.engine.infer_batch(batch, completion_log_probs)["logps"].tolist()
            for n, i in enumerate(chunk):
                self._cache[(split, i)] = (logps[2 * n], logps[2 * n + 1])
        return [self._cache[(split, i)] for i in indices]

    def release(self) -> None:
        """Free the reference engine (every needed log-prob is cached)."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None


def _pair_batch(
    kind: str,
    items: list[TokenizedPair],
    pad_id: int,
    refs: list[tuple] | None,
) -> Any:
    return collate_pairs(items, pad_id, ref_logps=refs, margin=kind == "rm")


def _validate(
    kind: str,
    engine: Any,
    val: PreferenceDataset,
    refs: _ReferenceLogProbs | None,
    terms: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]],
    batch_size: int,
    pad_id: int,
) -> dict[str, float]:
    """Held-out loss and pair metrics, exact means over every validation pair."""
    from polyrl.trainer.preference_losses import completion_log_probs, last_token_scores

    sums: dict[str, float] = {}
    count = 0
    for start in range(0, len(val), batch_size):
        indices = list(range(start, min(start + batch_size, len(val))))
        items = [val[i] for i in indices]
        if kind == "dpo":
            ref = refs.get("val", val, indices) if refs is not None else None
            batch = _pair_batch(kind, items, pad_id, ref)
            out = engine.infer_batch(batch, completion_log_probs)
            ref_t = batch["ref_logps"] if ref is not None else None
            losses, metrics = terms(out["logps"], out["num_tokens"], ref_t)
        else:
            batch = _pair_batch(kind, items, pad_id, None)
            scores = engine.infer_batch(batch, last_token_scores)["scores"]
            losses, metrics = terms(scores, batch["margin"])
        for name, values in {"loss": losses, **metrics}.items():
            sums[name] = sums.get(name, 0.0) + float(values.sum())
        count += len(items)
    return {f"val/{name}": total / count for name, total in sums.items()}


def _build_engines(
    cfg: PolyRLConfig,
    kind: str,
    model_dir: Path,
    total: int,
    need_ref: bool,
    ref_model_dir: Path | None,
) -> tuple[Any, Any]:
    from polyrl.model_engine import (
        CheckpointConfig,
        ModelSpec,
        OptimizerConfig,
        build_engine,
    )

    opts = getattr(cfg, kind)
    engine_cfg, optimizer_cfg = engine_configs(cfg, opts, total)
    common = {"dtype": cfg.model.dtype, "trust_remote_code": cfg.model.trust_remote_code}
    if kind == "rm":
        spec = ModelSpec(path=str(model_dir), kind="value", value_head_bias=False, **common)
    else:
        # model.* maps onto ModelSpec by field name (LoRA options included).
        spec = ModelSpec(**constructor_kwargs(ModelSpec, cfg.model, path=str(model_dir)))
    checkpoint = CheckpointConfig(max_to_keep=cfg.trainer.max_ckpt_to_keep)
    policy = build_engine(spec, engine_cfg, optimizer_cfg, checkpoint)
    ref = None
    if need_ref and spec.lora_rank and ref_model_dir is None and not cfg.dpo.ref_model_path:
        ref = _AdapterOff(policy)
    elif need_ref:
        try:
            ref_dir = ref_model_dir or Path(cfg.dpo.ref_model_path or model_dir)
            if not (ref_dir / "config.json").is_file():
                raise ConfigError(
                    f"{str(ref_dir)!r} is not a Hugging Face model directory (no config.json)",
                    key="dpo.ref_model_path",
                )
            # A reference engine never steps its optimizer (lr 0 keeps that obvious).
            ref = build_engine(
                ModelSpec(path=str(ref_dir), **common), engine_cfg, OptimizerConfig(lr=0.0)
            )
        except BaseException:
            policy.close()
            raise
    return policy, ref


def run_preference(
    cfg: PolyRLConfig,
    kind: str,
    *,
    train_rows: Sequence[Mapping[str, Any]] | None = None,
    val_rows: Sequence[Mapping[str, Any]] | None = None,
    model_dir: str | Path | None = None,
    ref_model_dir: str | Path | None = None,
) -> dict[str, Any]:
    """Run DPO (``kind="dpo"``) or reward-model training (``"rm"``); returns the summary.

    ``train_rows`` / ``val_rows`` replace the data files (the Python API passes in-memory
    datasets this way); ``model_dir`` / ``ref_model_dir`` replace ``model.path`` /
    ``dpo.ref_model_path``.
    """
    from polyrl.algo.preference import DPO_LOSSES
    from polyrl.data.sampler import StatefulSampler
    from polyrl.models.loader import load_tokenizer
    from polyrl.trainer.preference_losses import (
        DPO_METRICS,
        RM_METRICS,
        dpo_engine_loss,
        dpo_pair_terms,
        reward_model_engine_loss,
        reward_pair_terms,
    )

    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    started = time.perf_counter()
    trainer, data, opts = cfg.trainer, cfg.data, getattr(cfg, kind)
    max_length = opts.max_length or data.max_prompt_length + data.max_response_length
    _check_config(cfg, kind, max_length, train_rows is not None)
    out_dir = Path(trainer.output_dir).absolute()  # workers may run in another cwd (Ray)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_run_config(cfg, with_training_autos(cfg), out_dir / f"{kind}_config.yaml")

    model_path = Path(model_dir) if model_dir is not None else resolve_model_dir(cfg, out_dir)
    tokenizer = load_tokenizer(model_path, trust_remote_code=cfg.model.trust_remote_code)
    pad_id = int(tokenizer.pad_token_id)
    train_ds, val_ds = _load_pairs(cfg, kind, tokenizer, max_length, out_dir, train_rows, val_rows)
    if len(train_ds) < data.train_batch_size:
        raise ConfigError(
            f"{data.train_batch_size} exceeds the {len(train_ds)} training pairs",
            key="data.train_batch_size",
        )
    sampler = StatefulSampler(
        len(train_ds), data.train_batch_size, shuffle=data.shuffle, seed=cfg.seed_for("data")
    )
    total = (
        opts.total_steps or trainer.total_steps or trainer.total_epochs * sampler.batches_per_epoch
    )
    if kind == "dpo":
        reference_free = DPO_LOSSES.get(opts.loss_type).reference_free
        kwargs = {
            "beta": opts.beta,
            "loss_type": opts.loss_type,
            "label_smoothing": opts.label_smoothing,
            "simpo_gamma": opts.simpo_gamma,
        }
        loss_fn = functools.partial(dpo_engine_loss, **kwargs)
        terms = functools.partial(dpo_pair_terms, **kwargs)
        need_ref = not reference_free and not (
            train_ds.has_ref_logps and (val_ds is None or val_ds.has_ref_logps)
        )
        if not reference_free and not need_ref and opts.ref_model_path:
            # Said, not silent: the user named a reference model that this run never loads.
            _log(
                kind,
                f"dpo.ref_model_path={opts.ref_model_path!r} is not used: every pair carries "
                "precomputed reference log-probs (ref_chosen_logps / ref_rejected_logps)",
            )
    else:
        coef = opts.center_rewards_coefficient
        loss_fn = functools.partial(reward_model_engine_loss, center_rewards_coefficient=coef)
        terms = functools.partial(reward_pair_terms, center_rewards_coefficient=coef)
        reference_free, need_ref = True, False
    _log(
        kind,
        f"model {model_path} | {len(train_ds)} train / {len(val_ds) if val_ds else 0} val pairs "
        f"(max_length {max_length}, {train_ds.num_filtered} filtered) | {total} steps of "
        f"{data.train_batch_size} pairs"
        + ("" if kind == "rm" else f" | reference: {'model' if need_ref else 'none/columns'}"),
    )

    root = checkpoint_root(out_dir)
    loop = RunLoop(
        cfg,
        kind,
        out_dir,
        root,
        plot_keys=list(trainer.plot_metrics) or list(DEFAULT_PLOT_METRICS[kind]),
        started=started,
    )
    engine, ref_engine = _build_engines(
        cfg,
        kind,
        model_path,
        total,
        need_ref,
        Path(ref_model_dir) if ref_model_dir is not None else None,
    )
    refs = None
    if kind == "dpo" and not reference_free:
        refs = _ReferenceLogProbs(ref_engine, pad_id, data.val_batch_size)
    run = _PreferenceRun(
        cfg,
        kind,
        engine,
        refs,
        sampler,
        train_ds,
        val_ds,
        pad_id,
        total_steps=total,
        root=root,
        loss_fn=loss_fn,
        terms=terms,
        pair_metrics=DPO_METRICS if kind == "dpo" else RM_METRICS,
    )
    return loop.run(run)


@dataclasses.dataclass
class _PreferenceRun:
    """One DPO or RM run as the run loop's :class:`~polyrl.trainer.run_loop.LoopTrainer`."""

    cfg: PolyRLConfig
    kind: str
    engine: Any
    refs: _ReferenceLogProbs | None
    sampler: Any
    train_ds: PreferenceDataset
    val_ds: PreferenceDataset | None
    pad_id: int
    total_steps: int
    root: Path
    loss_fn: Callable[..., Any]
    terms: Callable[..., Any]
    #: The loss's per-pair metrics, logged with each step's.
    pair_metrics: Sequence[str]

    @property
    def has_validation(self) -> bool:
        return self.val_ds is not None

    def setup(self) -> None:
        """Precompute the reference log-probs when asked (then free the reference model)."""
        refs = self.refs
        if refs is not None and getattr(self.cfg, self.kind).precompute_ref_log_probs:
            refs.get("train", self.train_ds, range(len(self.train_ds)))
            if self.val_ds is not None:
                refs.get("val", self.val_ds, range(len(self.val_ds)))
            refs.release()

    def load(self, path: str) -> int:
        return restore_sampler(self.sampler, self.engine.load_checkpoint(path), path)

    def step(self, step: int) -> dict[str, float]:
        sampler, engine, refs = self.sampler, self.engine, self.refs
        indices = sampler.next_batch()
        items = [self.train_ds[i] for i in indices]
        ref = refs.get("train", self.train_ds, indices) if refs is not None else None
        batch = _pair_batch(self.kind, items, self.pad_id, ref)
        tick = time.perf_counter()
        out = engine.train_batch(batch, self.loss_fn)
        engine.lr_scheduler_step()
        elapsed = time.perf_counter() - tick
        metrics = {
            "train/loss": out["loss"],
            "train/grad_norm": out["grad_norm"],
            "train/lr": out["lr"],
            "train/tokens_per_s": float(batch["attention_mask"].sum()) / elapsed,
            "train/epoch": sampler.epoch + sampler.position / sampler.batches_per_epoch,
        }
        metrics.update({k: out[k] for k in self.pair_metrics})
        return metrics

    def validate(self) -> dict[str, float]:
        assert self.val_ds is not None
        batch_size = self.cfg.data.val_batch_size
        return _validate(
            self.kind, self.engine, self.val_ds, self.refs, self.terms, batch_size, self.pad_id
        )

    def save(self, step: int) -> str:
        state = {"sampler": self.sampler.state_dict()}
        return self.engine.save_checkpoint(str(self.root), step, state)

    def progress(self, metrics: Mapping[str, float]) -> dict[str, str]:
        return {"loss": f"{metrics['train/loss']:.4f}"}

    def finish(self) -> str | None:
        if not getattr(self.cfg, self.kind).export_hf:
            return None
        hf_dir = self.engine.export_hf(str(Path(self.cfg.trainer.output_dir) / HF_DIR))
        if self.kind == "rm":
            from polyrl.model_engine.heads import to_sequence_classifier

            to_sequence_classifier(hf_dir, pad_token_id=self.pad_id)
        _log(self.kind, f"model exported to {hf_dir}")
        return hf_dir

    def close(self) -> None:
        try:
            self.engine.close()
        finally:
            if self.refs is not None:
                self.refs.release()

    def summarize(self, records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        return {
            **first_and_last(records, ACCURACY[self.kind], "val_accuracy"),
            **first_and_last(records, "val/loss", "val_loss"),
        }


def run_dpo(cfg: PolyRLConfig, **kwargs: Any) -> dict[str, Any]:
    """Run DPO as configured (``cfg.dpo``); see :func:`run_preference`."""
    return run_preference(cfg, "dpo", **kwargs)


def run_rm(cfg: PolyRLConfig, **kwargs: Any) -> dict[str, Any]:
    """Train a reward model as configured (``cfg.rm``); see :func:`run_preference`."""
    return run_preference(cfg, "rm", **kwargs)
