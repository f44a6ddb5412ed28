"""The SFT trainer behind ``polyrl sft [PRESET] key=value ...``.

Supervised fine-tuning on multi-turn chats with the loss on assistant tokens only (see
:mod:`polyrl.trainer.sft_data`), on the model engine (:mod:`polyrl.model_engine`) with the built-in
``sft_loss``.  One run:

1. builds the tiny model when ``model.path`` is empty (as the demo does);
2. reads chats from ``data.train_files`` / ``data.val_files``, or generates ``data.task`` and
   turns each prompt plus its ground-truth answer into a two-turn chat;
3. trains ``trainer.total_steps`` steps (or ``trainer.total_epochs`` epochs) of
   ``data.train_batch_size`` conversations drawn by a resumable sampler, with a tqdm progress
   bar and one metrics line per step sent to ``trainer.loggers`` (:class:`Tracker`);
4. measures the validation loss (token-mean NLL over the whole validation set) every
   ``trainer.test_freq`` steps and at the end;
5. saves engine checkpoints (model, optimizer, scheduler, RNG, and the sampler position in
   ``extra_state``; atomic) every ``trainer.save_freq`` steps and at the end, under
   ``<output_dir>/checkpoints``; ``trainer.resume_mode=auto`` continues from the newest one;
6. writes a PNG of the loss curves, ``sft_summary.json`` and (``sft.export_hf``) the final model
   as a Hugging Face directory in ``<output_dir>/hf_model``.

World size 1 (``trainer.nnodes * trainer.n_gpus_per_node``) trains in this process.  A larger
world drives :class:`~polyrl.workers.engine.EngineWorker` ranks through a controller
:class:`~polyrl.controller.WorkerGroup` (``trainer.worker_backend``: Ray actors, or local
subprocesses); batches are padded with zero-loss rows to a multiple of the world size, so the
loss is exactly that of the mini-batch.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from polyrl.config import ConfigError, PolyRLConfig
from polyrl.config.schema import constructor_kwargs
from polyrl.core.batch import Batch
from polyrl.trainer.checkpointing import checkpoint_root
from polyrl.trainer.common import (
    check_devices,
    data_files,
    ray_init_options,
    resolve_model_dir,
    save_run_config,
    training_device,
    with_training_autos,
)
from polyrl.trainer.run_loop import RunLoop, first_and_last, series
from polyrl.trainer.sft_data import SFTDataError, SFTDataset, chats_from_rows, collate_chats

__all__ = [
    "DEFAULT_PLOT_METRICS",
    "SFTRunner",
    "engine_configs",
    "load_sft_datasets",
    "restore_sampler",
    "run_sft",
]

#: Metrics drawn in ``learning_curves.png`` when ``trainer.plot_metrics`` is empty.
DEFAULT_PLOT_METRICS = ("train/loss", "val/loss")
SUMMARY_FILE = "sft_summary.json"
HF_DIR = "hf_model"


def _log(message: str) -> None:
    from tqdm import tqdm

    tqdm.write(f"[sft] {message}", file=sys.stdout)
    sys.stdout.flush()


# ------------------------------------------------------------------------------ inputs
def _read_chats(files: list[str], cfg: PolyRLConfig) -> list[dict[str, Any]]:
    from polyrl.data.io import read_rows

    chats: list[dict[str, Any]] = []
    for name in files:
        rows = read_rows(name)
        chats += chats_from_rows(
            rows,
            cfg.sft.messages_key,
            cfg.data.prompt_key,
            source=name,
            image_key=cfg.data.image_key,
            video_key=cfg.data.video_key,
            base_dir=Path(name).resolve().parent,
        )
    return chats


def load_sft_datasets(
    cfg: PolyRLConfig,
    tokenizer: Any,
    max_length: int,
    out_dir: Path,
    processor: Any = None,
) -> tuple[SFTDataset, SFTDataset | None]:
    """Train and (when there is validation data) validation datasets for ``cfg``.

    With ``data.task`` the task's train/test splits are generated under ``data.data_dir``
    (default ``<out_dir>/data``) and each row becomes a chat ending in its ground truth;
    ``data.val_files``, when given, replace the generated test split. ``processor`` (a vision
    model's :class:`~polyrl.models.processor.VisionProcessor`) processes rows' images.
    """
    train_files, val_files = data_files(cfg, out_dir)
    kwargs = {
        "max_length": max_length,
        "truncation": cfg.sft.truncation,
        "apply_chat_template_kwargs": cfg.data.apply_chat_template_kwargs,
        "processor": processor,
    }
    train = SFTDataset(_read_chats(train_files, cfg), tokenizer, source="train data", **kwargs)
    val = None
    if val_files:
        val = SFTDataset(_read_chats(val_files, cfg), tokenizer, source="val data", **kwargs)
    return train, val


def engine_configs(cfg: PolyRLConfig, opts: Any, total_steps: int) -> tuple[Any, Any]:
    """``(EngineConfig, OptimizerConfig)`` from a trainer's option group.

    ``opts`` is a group with the SFT engine option names (``sft``, ``dpo``, ``rm``:
    dynamic_batching, micro_batch_size, max_tokens_per_micro_batch, gradient_checkpointing,
    share_prefix) and an ``optim`` group; both map onto the constructors by field name.
    """
    from polyrl.model_engine import EngineConfig, MixedPrecisionConfig, OptimizerConfig

    engine = EngineConfig(
        **constructor_kwargs(
            EngineConfig,
            opts,
            opts.optim,
            device=cfg.trainer.device,
            mixed_precision=MixedPrecisionConfig(param_dtype=cfg.model.compute_dtype),
            seed=cfg.seed,
        )
    )
    optimizer = OptimizerConfig(
        **constructor_kwargs(OptimizerConfig, opts.optim, total_steps=total_steps)
    )
    return engine, optimizer


def restore_sampler(sampler: Any, info: Mapping[str, Any], resume_from: str | Path) -> int:
    """Put the data sampler back where a checkpoint left it; returns the checkpoint's step.

    Raises:
        SFTDataError: the checkpoint holds no sampler state.
        ConfigError: the state does not fit this run's data settings.
    """
    state = info["extra_state"].get("sampler")
    if state is None:
        raise SFTDataError(f"checkpoint {resume_from} holds no data-sampler state")
    try:
        sampler.load_state_dict(state)
    except ValueError as exc:
        raise ConfigError(
            f"cannot resume from {resume_from}: {exc}; resume with the data settings "
            "of the original run (data.*, seed) or start a new output_dir",
            key="trainer.resume_mode",
        ) from None
    return int(info["step"])


# ------------------------------------------------------------------------------ runners
class SFTRunner:
    """Runs SFT steps on an in-process engine (world size 1) or on a controller worker group.

    Args:
        model, engine, optimizer, checkpoint: the engine configs (see :mod:`polyrl.model_engine`).
        world_size: number of data-parallel ranks; 1 trains in this process.
        worker_backend: ``"ray"`` or ``"local"`` for ``world_size > 1``.
        use_gpu: give each rank a GPU (``world_size > 1``).
        ray_options: ``ray.init`` keyword arguments used when Ray is not running yet.
    """

    def __init__(
        self,
        model: Any,
        engine: Any,
        optimizer: Any,
        checkpoint: Any,
        *,
        world_size: int = 1,
        worker_backend: str = "ray",
        use_gpu: bool = False,
        ray_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.world_size = world_size
        self._engine: Any = None
        self._group: Any = None
        self._started_ray = False
        if world_size == 1:
            from polyrl.model_engine import build_engine

            self._engine = build_engine(model, engine, optimizer, checkpoint)
            return
        from polyrl.controller import ResourcePool, WorkerGroup, WorkerSpec
        from polyrl.workers.engine import EngineWorker

        if worker_backend == "ray":
            import ray

            if not ray.is_initialized():
                ray.init(**dict(ray_options or {}))
                self._started_ray = True
        pool = ResourcePool(
            "sft", world_size, cpus_per_worker=1.0, gpus_per_worker=1.0 if use_gpu else 0.0
        )
        spec = WorkerSpec(
            EngineWorker,
            kwargs={
                "role": "actor",
                "model": model,
                "engine": engine,
                "optimizer": optimizer,
                "checkpoint": checkpoint,
            },
        )
        try:
            self._group = WorkerGroup(spec, pool=pool, backend=worker_backend, name="sft")
            self._group.init_model()
        except BaseException:
            self.close()
            raise

    def _padded(self, batch: Batch) -> Batch:
        from polyrl.workers.engine import pad_batch_for_dp

        return pad_batch_for_dp(batch, self.world_size)[0]

    def train_step(self, batch: Batch) -> dict[str, float]:
        """One optimizer step on ``batch`` plus one LR-schedule step; the engine's metrics."""
        if self._engine is not None:
            from polyrl.model_engine import sft_loss

            metrics = self._engine.train_batch(batch, sft_loss)
            self._engine.lr_scheduler_step()
            return metrics
        out = self._group.update_actor(self._padded(batch), "sft")
        return {k.removeprefix("actor/"): v for k, v in out.items()}

    def eval_loss(self, batch: Batch) -> dict[str, float]:
        """Forward-only SFT loss (eval mode): ``loss`` and ``num_tokens`` among the metrics."""
        if self._engine is not None:
            from polyrl.model_engine import sft_loss

            with self._engine.eval_mode():
                return self._engine.forward_backward(batch, sft_loss, forward_only=True)
        return self._group.evaluate_loss(self._padded(batch), "sft")

    def save(self, root: str, step: int, extra_state: Mapping[str, Any]) -> str:
        """Atomic engine checkpoint ``<root>/global_step_<step>``."""
        if self._engine is not None:
            return self._engine.save_checkpoint(root, step, extra_state)
        return self._group.save_checkpoint(root, step, dict(extra_state))[0]

    def load(self, path: str) -> dict[str, Any]:
        """Restore a checkpoint; ``{"step", "extra_state", "path"}``."""
        if self._engine is not None:
            return self._engine.load_checkpoint(path)
        return self._group.load_checkpoint(path)[0]

    def export_hf(self, directory: str) -> str:
        """Write the model as a Hugging Face directory (tokenizer copied from the model dir)."""
        if self._engine is not None:
            return self._engine.export_hf(directory)
        return self._group.export_hf(directory)[0]

    def close(self) -> None:
        """Release the engine, the worker group and a Ray runtime this runner started."""
        if self._engine is not None:
            self._engine.close()
            self._engine = None
        if self._group is not None:
            try:
                if self._group.is_alive:
                    self._group.close_model()
            finally:
                self._group.shutdown()
                if self._group.backend == "ray":
                    self._group.pool.release()  # the runner made this pool
                self._group = None
        if self._started_ray:
            import ray

            ray.shutdown()
            self._started_ray = False


# ------------------------------------------------------------------------------ the loop
def _validate(runner: SFTRunner, val: SFTDataset, batch_size: int, pad_id: int) -> dict[str, float]:
    weighted = 0.0
    tokens = 0.0
    for start in range(0, len(val), batch_size):
        batch = collate_chats(val.items[start : start + batch_size], pad_id)
        metrics = runner.eval_loss(batch)
        weighted += metrics["loss"] * metrics["num_tokens"]
        tokens += metrics["num_tokens"]
    return {"val/loss": weighted / max(tokens, 1.0), "val/num_tokens": tokens}


def _check_config(cfg: PolyRLConfig, max_length: int) -> None:
    from polyrl.trainer.tracking import check_trackers

    check_devices(cfg)
    check_trackers(cfg.trainer.loggers)
    sft = cfg.sft
    if not cfg.data.task and not cfg.data.train_files:
        raise ConfigError(
            "no training data: set data.task (a generated task) or data.train_files "
            "(parquet/jsonl rows with a messages column, or prompt + ground truth)",
            key="data.train_files",
        )
    if sft.dynamic_batching and sft.max_tokens_per_micro_batch < max_length:
        raise ConfigError(
            f"{sft.max_tokens_per_micro_batch} is below the longest allowed conversation "
            f"({max_length} tokens); raise it to at least sft.max_length",
            key="sft.max_tokens_per_micro_batch",
        )
    if max_length < 2:
        raise ConfigError(f"must be >= 2 tokens, got {max_length}", key="sft.max_length")


def run_sft(cfg: PolyRLConfig) -> dict[str, Any]:
    """Run SFT as configured (see the module docstring); returns the summary it writes."""
    from polyrl.data.sampler import StatefulSampler
    from polyrl.model_engine import CheckpointConfig, ModelSpec
    from polyrl.models.loader import load_tokenizer
    from polyrl.models.processor import load_vision_processor

    started = time.perf_counter()
    trainer, sft, data = cfg.trainer, cfg.sft, cfg.data
    max_length = sft.max_length or data.max_prompt_length + data.max_response_length
    _check_config(cfg, max_length)
    out_dir = Path(trainer.output_dir).absolute()  # workers may run in another cwd (Ray)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_run_config(cfg, with_training_autos(cfg), out_dir / "sft_config.yaml")

    model_dir = resolve_model_dir(cfg, out_dir)
    tokenizer = load_tokenizer(model_dir, trust_remote_code=cfg.model.trust_remote_code)
    processor = load_vision_processor(
        model_dir,
        tokenizer=tokenizer,
        min_pixels=data.image_min_pixels or None,
        max_pixels=data.image_max_pixels or None,
    )
    train_ds, val_ds = load_sft_datasets(cfg, tokenizer, max_length, out_dir, processor)
    if len(train_ds) < data.train_batch_size:
        raise ConfigError(
            f"{data.train_batch_size} exceeds the {len(train_ds)} training conversations",
            key="data.train_batch_size",
        )
    sampler = StatefulSampler(
        len(train_ds), data.train_batch_size, shuffle=data.shuffle, seed=cfg.seed_for("data")
    )
    total = (
        sft.total_steps or trainer.total_steps or trainer.total_epochs * sampler.batches_per_epoch
    )
    dropped = train_ds.num_filtered + (val_ds.num_filtered if val_ds else 0)
    _log(
        f"model {model_dir} | {len(train_ds)} train / {len(val_ds) if val_ds else 0} val chats "
        f"(max_length {max_length}, {dropped} filtered) | {total} steps of "
        f"{data.train_batch_size} | world size {trainer.world_size}"
    )

    root = checkpoint_root(out_dir)
    # Before the engine is built: a bad resume path should fail fast.
    loop = RunLoop(
        cfg,
        "sft",
        out_dir,
        root,
        plot_keys=list(trainer.plot_metrics) or list(DEFAULT_PLOT_METRICS),
        started=started,
    )
    use_gpu = training_device(cfg) == "cuda"
    engine_cfg, optimizer_cfg = engine_configs(cfg, sft, total)
    runner = SFTRunner(
        # model.* maps onto ModelSpec by field name (dtype, trust_remote_code, the LoRA options).
        ModelSpec(**constructor_kwargs(ModelSpec, cfg.model, path=str(model_dir))),
        engine_cfg,
        optimizer_cfg,
        CheckpointConfig(max_to_keep=trainer.max_ckpt_to_keep),
        world_size=trainer.world_size,
        worker_backend=trainer.worker_backend,
        use_gpu=use_gpu,
        ray_options=ray_init_options(cfg),
    )
    run = _SFTRun(cfg, runner, sampler, train_ds, val_ds, int(tokenizer.pad_token_id), total, root)
    return loop.run(run)


@dataclasses.dataclass
class _SFTRun:
    """One SFT run as the run loop's :class:`~polyrl.trainer.run_loop.LoopTrainer`."""

    cfg: PolyRLConfig
    runner: SFTRunner
    sampler: Any
    train_ds: SFTDataset
    val_ds: SFTDataset | None
    pad_id: int
    total_steps: int
    root: Path

    @property
    def has_validation(self) -> bool:
        return self.val_ds is not None

    def setup(self) -> None:
        """Nothing: the runner is built before the loop (a bad setting fails before it)."""

    def load(self, path: str) -> int:
        return restore_sampler(self.sampler, self.runner.load(path), path)

    def step(self, step: int) -> dict[str, float]:
        sampler = self.sampler
        batch = collate_chats([self.train_ds[i] for i in sampler.next_batch()], self.pad_id)
        tick = time.perf_counter()
        out = self.runner.train_step(batch)
        elapsed = time.perf_counter() - tick
        return {
            "train/loss": out["loss"],
            "train/grad_norm": out["grad_norm"],
            "train/lr": out["lr"],
            "train/loss_tokens": out["num_tokens"],
            "train/tokens_per_s": float(batch["attention_mask"].sum()) / elapsed,
            "train/epoch": sampler.epoch + sampler.position / sampler.batches_per_epoch,
        }

    def validate(self) -> dict[str, float]:
        assert self.val_ds is not None
        return _validate(self.runner, self.val_ds, self.cfg.data.val_batch_size, self.pad_id)

    def save(self, step: int) -> str:
        return self.runner.save(str(self.root), step, {"sampler": self.sampler.state_dict()})

    def progress(self, metrics: Mapping[str, float]) -> dict[str, str]:
        return {"loss": f"{metrics['train/loss']:.4f}"}

    def finish(self) -> str | None:
        if not self.cfg.sft.export_hf:
            return None
        tick = time.perf_counter()
        hf_dir = self.runner.export_hf(str(Path(self.cfg.trainer.output_dir) / HF_DIR))
        _log(f"model exported to {hf_dir} in {time.perf_counter() - tick:.2f}s")
        return hf_dir

    def close(self) -> None:
        self.runner.close()

    def summarize(self, records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        train_losses = series(records, "train/loss")
        return {
            **first_and_last(records, "val/loss", "val_loss"),
            "last_train_loss": train_losses[-1] if train_losses else None,
        }
