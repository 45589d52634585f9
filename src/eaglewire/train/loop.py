"""The training loop of both draft families (EAGLE-3's TTT unroll, DFlash's parallel blocks:
``train/objectives.py``): data split, draft vocabulary, optimisation, evaluation,
checkpoints and exact resume. Runs alone or under ``torchrun`` (data parallel: each rank
takes every world-th batch, each step's loss is normalised over all ranks and gradients summed;
gloo on CPU, NCCL on GPU).
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import threading
import time
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from eaglewire.core.contract import HiddenStateContract, default_aux_boundaries
from eaglewire.core.device import resolve_device
from eaglewire.core.distributed import dist_rank_world
from eaglewire.core.locks import directory_lock
from eaglewire.core.precision import log_precision, resolve_precision
from eaglewire.data.batching import pack_by_tokens
from eaglewire.data.sources import Batch, OnlineSource, ShardSource, Source
from eaglewire.model.checkpoint import save_draft
from eaglewire.model.label_head import label_head
from eaglewire.model.target import Target, load_target
from eaglewire.model.ttt import COUNT_FIELDS, StepCounts
from eaglewire.model.vocab import count_tokens, frequency_coverage
from eaglewire.train.curves import Curves, open_curves, require as require_curves
from eaglewire.train.flops import DraftShape, Utilisation, attention_length, eagle3_train_flops, utilisation
from eaglewire.train.objectives import DFlashObjective, Eagle3Objective, Objective, default_gamma, summary_loss
from eaglewire.train.prefetch import InStep, Prefetcher
from eaglewire.train.run_state import (METRICS_FILE, History, Position, RunState, TrainingError, TrainResult,
                                       init_lineage, load_state, save_state, truncate_metrics)
from eaglewire.train.train_config import TrainConfig

log = logging.getLogger(__name__)

__all__ = ["TrainResult", "Trainer", "TrainingError", "batch_plan", "lr_lambda", "split_indices",
           "summarize", "train", "truncate_metrics"]


# ------------------------------------------------------------------ pure helpers

def split_indices(n: int, val_sequences: int, seed: int) -> tuple[list[int], list[int]]:
    """A fixed random split: (train indices, held-out indices)."""
    if n < 2:
        raise ValueError(f"need at least 2 sequences to train and validate, got {n}")
    val = min(val_sequences, max(1, n // 10))
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return sorted(order[val:]), sorted(order[:val])


def batch_plan(indices: list[int], lengths: list[int], batch_tokens: int, seed: int) -> list[list[int]]:
    """Group sequences into batches with rows x longest <= batch_tokens, in a seeded order.

    Sequences are sorted by length inside windows of 64 to limit padding, then the
    batches are shuffled.
    """
    rng = random.Random(seed)
    order = list(indices)
    rng.shuffle(order)
    batches: list[list[int]] = []
    for w in range(0, len(order), 64):
        window = sorted(order[w:w + 64], key=lambda i: lengths[i])
        batches += pack_by_tokens(window, [lengths[i] for i in window], batch_tokens)
    rng.shuffle(batches)
    return batches


def lr_lambda(step: int, warmup: int, total: int) -> float:
    """Linear warmup, then cosine decay to zero at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.5 * (1 + math.cos(math.pi * progress))


def summarize(counts: list[StepCounts], *, weights: list[float], prefix: str = "") -> dict[str, float]:
    """Loss (weighted as the objective weighs its positions) and accuracy per predicted position:
    ``acc_j`` is TTT step j (EAGLE-3) or drafted block position j + 1 (DFlash)."""
    out: dict[str, float] = {f"{prefix}loss": summary_loss(counts, weights)}
    for j, c in enumerate(counts):
        out[f"{prefix}acc_{j}"] = round(c.acc, 4)
        if j:
            out[f"{prefix}cond_acc_{j}"] = round(c.cond_acc, 4)
    return out


def early_stop_reason(evals: list[dict[str, float]], patience: int) -> str | None:
    """Why training stops here (None: it goes on): the held-out loss (``val_loss``) has not reached a new low in
    the last ``patience`` evaluations (0: never stops)."""
    if patience < 1 or len(evals) <= patience:
        return None
    losses = [e["val_loss"] for e in evals]
    best = min(range(len(losses)), key=losses.__getitem__)
    if len(losses) - 1 - best < patience:
        return None
    return (f"the held-out loss has not fallen below its low of {losses[best]:.4f} (step {evals[best]['step']}) "
            f"in the {patience} evaluation(s) since")


# ------------------------------------------------------------------ the trainer

class Trainer:
    def __init__(self, config: TrainConfig, target: Target | None = None) -> None:
        self.config = config
        self.rank, self.world = dist_rank_world()
        self.device = resolve_device(config.device)
        if self.world > 1 and not dist.is_initialized():
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")
        if self.device.type == "cuda" and self.world > 1:
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        self.out = Path(config.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.precision = resolve_precision(config.dtype, self.device)
        if self.rank == 0:
            log_precision(self.precision, "train")
            require_curves(config.report_to)  # before the target loads: name the missing package now
        if target is None and config.head_only:
            from eaglewire.model.target_head import load_target_head

            target = load_target_head(config.target, device=self.device)
        self.target = target or load_target(config.target, device=self.device)
        allow = set(config.allow_target_mismatch or ())
        if config.data is not None:
            self.source: Source = ShardSource(config.data, self.target, allow=allow,
                                              allow_incomplete=config.allow_incomplete_data)
        else:
            self.source = self._online_source()
        if config.data is not None:
            from eaglewire.data.import_data import ABSENT_LAST

            if self.source.dataset.manifest["source"].get("last_hidden") == ABSENT_LAST:
                raise TrainingError(f"--data {config.data} holds no boundary-L state (imported with --no-last), "
                                    "the target's signal in training; import a capture that holds it")
            if not config.skip_label_check:
                from eaglewire.data.label_check import require_labels

                require_labels(self.source.dataset, self.target, where=f"train --data {config.data}")
        self.contract: HiddenStateContract = self.source.contract.for_family(config.family)
        self.objective: Objective = self._objective()
        self.positions = self.objective.positions
        self.val_source: Source = self.source
        if config.val_data is not None:  # validation on other data: --data is trained on whole
            self.val_source = self._val_source(allow)
            self.train_idx = list(range(len(self.source.sequence_ids)))
            self.val_idx = list(range(min(config.val_sequences, len(self.val_source.sequence_ids))))
        else:
            self.train_idx, self.val_idx = split_indices(len(self.source.sequence_ids), config.val_sequences,
                                                         config.seed)
        self.init_lineage: list[dict[str, Any]] = []  # the --init-draft runs this one continues
        self.timers = {"target_head": 0.0, "draft_forward": 0.0, "backward": 0.0, "data": 0.0}
        # On a GPU every read of a device value stalls the host until the device catches up, and a boolean-mask
        # selection is a read (its shape): the step runs the head and the loss at every position, masked, and
        # reads the non-finite flag at the next log row. On the CPU nothing stalls: the step selects the counted
        # positions (fewer FLOPs) and reads its flag before the update.
        self.dense = config.sync_free == "on" or (config.sync_free == "auto" and config.family == "eagle3"
                                                  and self.device.type == "cuda")
        self._read_lock = threading.Lock()  # the prefetch thread and evaluation read the same shards
        self.device_name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"

    def _val_source(self, allow: set[str]) -> ShardSource:
        """--val-data: shards of the same states of the same target as --data, storing the same kind of labels."""
        cfg = self.config
        val = ShardSource(cfg.val_data, self.target, allow=allow)
        self.source.contract.check_same(val.contract, what=f"--val-data {cfg.val_data}", allow=allow)
        ours, theirs = (src.dataset.storage.labels for src in (self.source, val))
        if ours != theirs:
            raise TrainingError(f"--val-data {cfg.val_data} stores {theirs} labels and --data {cfg.data} {ours}: "
                                "prepare both with the same --labels")
        if not val.sequence_ids:
            raise TrainingError(f"--val-data {cfg.val_data} holds no sequence")
        return val

    def _online_source(self) -> OnlineSource:
        from eaglewire.data.prepare import resolve_data

        cfg = self.config
        bounds = cfg.aux_boundaries or default_aux_boundaries(self.target.num_layers)
        contract = HiddenStateContract(aux_boundaries=tuple(bounds), target=self.target.fingerprint,
                                       chat_template_kwargs={})  # rendered with the template's defaults
        return OnlineSource(resolve_data(cfg.online_data), self.target, contract, limit=cfg.num_conversations,
                            offset=cfg.offset, max_length=cfg.max_length)

    # -- model and optimiser -------------------------------------------------

    def _objective(self) -> Objective:
        cfg = self.config
        head = label_head(self.target, self.precision.dtype)  # the labels in the training precision
        if cfg.family == "dflash":
            return DFlashObjective(self.target, block_size=cfg.block_size, layers=cfg.draft_layers,
                                   anchors=cfg.anchors_per_sequence,
                                   gamma=cfg.block_loss_gamma or default_gamma(cfg.block_size),
                                   mask_token_id=cfg.mask_token_id, seed=cfg.seed,
                                   draft_vocab_size=cfg.draft_vocab_size, head=head)
        return Eagle3Objective(self.target, ttt_steps=cfg.ttt_steps, loss_decay=cfg.loss_decay,
                               draft_vocab_size=cfg.draft_vocab_size, head=head)

    def build_draft(self) -> tuple[torch.nn.Module, float]:
        cfg, target = self.config, self.target
        if cfg.draft_vocab_size is not None and cfg.draft_vocab_size > target.vocab_size:
            raise ValueError(f"draft_vocab_size {cfg.draft_vocab_size} is larger than the target vocabulary "
                             f"({target.vocab_size}); pick at most {target.vocab_size}")
        torch.manual_seed(cfg.seed)
        counts = count_tokens((self.source.tokens(i) for i in self.train_idx), target.vocab_size)
        draft = self.objective.build(target, self.contract.num_aux, counts)
        if cfg.init_draft:
            draft = self._initial_draft(draft.config)
        coverage = frequency_coverage(counts, draft.t2d)  # both on the host, before the draft moves
        return draft.to(self.device), coverage

    def _initial_draft(self, dcfg) -> torch.nn.Module:
        """The --init-draft weights, checked to fit this run: same contract and architecture, and
        none of its held-out sequences in this run's training split."""
        from eaglewire.engines.formats.foreign_draft import load_any_draft

        draft, contract, stored, _ = load_any_draft(self.config.init_draft, target=self.target)  # foreign: converted
        self.contract.check_same(contract, what=f"--init-draft {self.config.init_draft}")
        if draft.config != dcfg:
            diff = {k: (v, getattr(dcfg, k)) for k, v in draft.config.to_dict().items() if getattr(dcfg, k) != v}
            raise TrainingError(f"--init-draft {self.config.init_draft} has another architecture "
                                f"({'; '.join(f'{k} {a!r} vs {b!r}' for k, (a, b) in diff.items())}); "
                                "match --draft-vocab-size or start from scratch")
        training = stored.get("training", {})
        self.init_lineage = init_lineage(self.config.init_draft, training)
        held = set(training.get("heldout_sequence_ids", []))
        leaked = held & {self.source.sequence_ids[i] for i in self.train_idx}
        if leaked:
            raise TrainingError(f"--init-draft {self.config.init_draft} held out {len(leaked)} sequence(s) that "
                                "this run trains on (e.g. " + ", ".join(map(str, sorted(leaked)[:3])) +
                                "); keep --seed and --val-sequences as in that run so validation stays held out")
        return draft.float().train()

    def _signal(self, draft, batch: Batch, *, evaluation: bool = False):
        """The target's signal where the objective reads it (timed as target head)."""
        t0 = time.perf_counter()
        signal = self.objective.signal(draft, batch, evaluation=evaluation, dense=self.dense and not evaluation)
        self.timers["target_head"] += time.perf_counter() - t0
        return signal

    def _unroll(self, draft, batch: Batch, signal, normalizers: torch.Tensor | None = None, *,
                evaluation: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(weighted loss, counts [positions, COUNT_FIELDS] on the device) of one batch (timed as draft forward)."""
        t0 = time.perf_counter()
        with self.precision.autocast():  # the loss and softmax stay fp32 inside (the objectives cast)
            out = self.objective.loss(draft, batch, signal, normalizers, dense=self.dense and not evaluation)
        self.timers["draft_forward"] += time.perf_counter() - t0
        return out

    def _read(self, idx: list[int], device: torch.device, source: Source | None = None) -> Batch:
        with self._read_lock:
            return (source or self.source).batch(idx, device)

    def _batches(self, plan: list[list[int]]) -> Prefetcher | InStep:
        """The training batches of ``plan`` in order: read ahead on a thread from shards, in the step online
        (capture runs the target) or with --prefetch 0."""
        if self.config.prefetch and self.config.data is not None:
            return Prefetcher(lambda idx: self._read(idx, torch.device("cpu")), plan, self.device,
                              depth=self.config.prefetch)
        return InStep(lambda idx: self._read(idx, self.device), plan, self.device)

    def _train_step(self, draft, optimizer, batches: list[Batch], idxs: list[list[int]],
                    where: Position) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One optimizer step over this rank's micro-batches ``batches`` (sequences ``idxs``); every rank's
        parts add up to the loss of the whole step (normalised by the step's global count of positions per TTT
        step), so N ranks x M micro-batches train exactly as one process with N x M micro-batches.

        The normalizers, counts and losses stay device tensors, summed over ranks by two all-reduces. Returns
        the step's counts summed over ranks ([positions, COUNT_FIELDS] float64 on the device) and, when
        ``self.dense``, its unread non-finite flag [M + 1] (this rank's micro-batch losses, then whether any
        rank's was not finite): nothing in the step waits for the device, and ``_check_finite`` reads the flag
        before the next log row, evaluation or save. Otherwise (a CPU: nothing to wait for) the step reads the
        flag before its update, raises at a bad step with the weights still the last good ones, and returns None."""
        cfg = self.config
        signals = [self._signal(draft, b) for b in batches]
        local = torch.stack([self.objective.counted(b, s) for b, s in zip(batches, signals)]).sum(0)  # [positions]
        normalizers = self._all_sum(local)
        optimizer.zero_grad(set_to_none=True)
        counts = torch.zeros(self.positions, COUNT_FIELDS, dtype=torch.float64, device=self.device)
        losses = []
        for batch, signal in zip(batches, signals):
            loss, c = self._unroll(draft, batch, signal, normalizers)
            t1 = time.perf_counter()
            loss.backward()  # a non-finite loss is flagged below
            self.timers["backward"] += time.perf_counter() - t1
            counts += c
            losses.append(loss.detach().double())
        losses = torch.stack(losses)  # [M]
        # One sum over ranks: whether any loss was not finite (every rank then stops together; a lone rank
        # raising would leave the others in all_reduce) and the step's counts.
        summed = self._all_sum(torch.cat([(~torch.isfinite(losses)).any().double()[None], counts.flatten()]))
        flag = torch.cat([losses, summed[:1]])  # [M + 1]
        if not self.dense:
            self._raise_if_not_finite([(where, idxs, flag)])
        t1 = time.perf_counter()
        self._sync_grads(draft)
        torch.nn.utils.clip_grad_norm_(draft.parameters(), cfg.grad_clip)
        optimizer.step()
        self.timers["backward"] += time.perf_counter() - t1
        return summed[1:].view(self.positions, COUNT_FIELDS), flag if self.dense else None

    def _all_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum a device tensor over ranks, in place, without reading it (identity when alone)."""
        if self.world > 1:
            dist.all_reduce(t)
        return t

    def _check_finite(self, run: RunState) -> None:
        """Read the non-finite flags of the steps since the last check (one read); raise at the first bad step."""
        pending, run.unchecked = run.unchecked, []
        self._raise_if_not_finite(pending)

    def _raise_if_not_finite(self, pending: list[tuple[Position, list[list[int]], torch.Tensor]]) -> None:
        if not pending:
            return
        flags = torch.cat([flag for _, _, flag in pending]).tolist()  # the one read
        for where, idxs, _ in pending:
            *losses, anyone = flags[:len(idxs) + 1]
            flags = flags[len(idxs) + 1:]
            if anyone:
                bad = next((i for i, v in enumerate(losses) if not math.isfinite(v)), None)
                what = (f"loss is {losses[bad]} at step {where.step} (epoch {where.epoch}, batch {where.batch + bad}, "
                        f"sequences {[self.source.sequence_ids[i] for i in idxs[bad]]})" if bad is not None else
                        f"another rank's loss is not finite at step {where.step}")
                raise TrainingError(f"{what}; the last good checkpoint in {self.out} is kept")

    @torch.no_grad()
    def evaluate(self, draft) -> dict[str, float]:
        """Loss and accuracies on the held-out split (each batch on its own), the draft-vocabulary coverage."""
        draft.eval()
        total = torch.zeros(self.positions, COUNT_FIELDS, dtype=torch.float64, device=self.device)
        inside = counted = 0
        for idx in batch_plan(self.val_idx, self.val_source.lengths, self.config.batch_tokens, seed=0):
            batch = self._read(idx, self.device, self.val_source)
            signal = self._signal(draft, batch, evaluation=True)
            total += self._unroll(draft, batch, signal, evaluation=True)[1]
            n_in, n = self.objective.coverage(batch, signal)
            inside, counted = inside + n_in, counted + n
        draft.train()
        return {**summarize(StepCounts.rows(total), prefix="val_", weights=self.objective.weights),
                "val_vocab_coverage": round(inside / max(counted, 1), 4)}

    # -- checkpointing -------------------------------------------------------

    # -- the loop ------------------------------------------------------------

    def run(self, progress: bool = True) -> TrainResult:
        run = self._start_run(progress)
        try:
            while run.position.epoch < self.config.epochs and run.position.step < run.total_steps:
                if not self._run_epoch(run):
                    run.stopped_early = True
                    break
            self._finish_run(run)
        finally:
            run.bar.close()
            if run.metrics_file:
                run.metrics_file.close()
            if run.curves:
                run.curves.close()
        if self.rank == 0:
            self._plot()
        return self._result(run)

    def _start_run(self, progress: bool) -> RunState:
        """Draft, optimiser, schedule and batch plans of this run, resumed from --out's state file
        when asked."""
        cfg = self.config
        start = time.perf_counter()
        draft, coverage = self.build_draft()
        self.draft = draft  # kept for callers (and tests) after the run
        if cfg.compile:
            from eaglewire.train.compiled import compile_layer

            compile_layer(draft, self.precision)
        # One fused kernel for the whole update on a GPU (the CPU keeps its default: the same arithmetic as before).
        optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=cfg.lr,
                                      betas=(0.9, 0.95), weight_decay=cfg.weight_decay,
                                      fused=True if self.device.type == "cuda" else None)
        plans = [batch_plan(self.train_idx, self.source.lengths, cfg.batch_tokens, cfg.seed + e)
                 for e in range(cfg.epochs)]
        # Every rank takes the same number of micro-batches per step (gradients are all-reduced).
        per_epoch = min(len(p) for p in plans) // (self.world * cfg.grad_accum)
        if per_epoch < 1:
            raise ValueError(f"{len(plans[0])} batch(es) per epoch cannot feed {self.world} rank(s) x "
                             f"{cfg.grad_accum} micro-batch(es); lower --batch-tokens or --grad-accum, or use more data")
        total_steps = min(cfg.max_steps or per_epoch * cfg.epochs, per_epoch * cfg.epochs)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: lr_lambda(s, min(cfg.warmup_steps, total_steps // 10 + 1), total_steps))
        position, history = Position(), History()
        state = load_state(self.out, cfg)
        if state is not None:
            draft.load_state_dict(state["draft"])
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
            torch.set_rng_state(state["rng"])
            position, history = Position(**state["position"]), History(**state["history"])
            history.stop_reason = early_stop_reason(history.evals, cfg.early_stop)  # --early-stop may differ now
            log.info("resuming %s at step %d (epoch %d, batch %d)", self.out, position.step,
                     position.epoch, position.batch)
        draft.train()
        if self.rank == 0:
            truncate_metrics(self.out / METRICS_FILE, position.step)
        return RunState(
            draft=draft, optimizer=optimizer, scheduler=scheduler, plans=plans, per_epoch=per_epoch,
            total_steps=total_steps, coverage=coverage, start=start, position=position, history=history,
            window=self._empty_window(), flops_per_token=self._flops_per_token(draft),
            metrics_file=open(self.out / METRICS_FILE, "a") if self.rank == 0 else None,
            curves=open_curves(cfg.report_to, self.out, resume_step=position.step) if self.rank == 0 else None,
            log_time=time.perf_counter(), log_tokens=position.tokens,
            bar=tqdm(total=total_steps, initial=position.step, desc="train", unit="step",
                     disable=not progress or self.rank != 0))

    def _run_epoch(self, run: RunState) -> bool:
        """Steps of the current epoch from where ``run`` stands; False when stopped early
        (--minutes, --stop-at-step)."""
        cfg, position = self.config, run.position
        plan = run.plans[position.epoch]
        # Step s of rank r takes plan[(s * A + i) * world + r] for i < A (A = grad_accum):
        # over all ranks, the step's micro-batches are plan[s*A*world : (s+1)*A*world].
        mine = plan[self.rank::self.world][:run.per_epoch * cfg.grad_accum]
        ahead = mine[position.batch:position.batch + (run.total_steps - position.step) * cfg.grad_accum]
        batches = self._batches(ahead)
        try:
            while position.batch < len(mine) and position.step < run.total_steps:
                out_of_time = cfg.minutes is not None and time.perf_counter() - run.start > cfg.minutes * 60
                if out_of_time or position.step == cfg.stop_at_step or run.history.stop_reason:
                    return False
                idxs = mine[position.batch:position.batch + cfg.grad_accum]
                t0 = time.perf_counter()
                step_batches = [next(batches) for _ in idxs]
                self.timers["data"] += time.perf_counter() - t0
                where = Position(**asdict(position))
                counts, flag = self._train_step(run.draft, run.optimizer, step_batches, idxs, where)
                if flag is not None:
                    run.unchecked.append((where, idxs, flag))
                run.scheduler.step()
                run.window += counts
                # The step's tokens over all ranks, from the plan every rank holds (no communication).
                everyone = plan[position.batch * self.world:(position.batch + len(idxs)) * self.world]
                position.tokens += sum(self.source.lengths[i] for idx in everyone for i in idx)
                position.batch += len(idxs)
                position.step += 1
                run.bar.update(1)
                self._after_step(run)
        finally:
            batches.close()
        if position.batch >= len(mine):
            position.epoch += 1
            position.batch = 0
        return True

    def _after_step(self, run: RunState) -> None:
        """Log the window of steps, evaluate and save at their intervals (each after the non-finite check of
        the steps since the last one: a bad step stops the run before its weights are evaluated or saved)."""
        cfg, step = self.config, run.position.step
        logged = step % cfg.log_interval == 0 or step == run.total_steps
        due = logged or step % cfg.eval_interval == 0 or step % cfg.save_interval == 0
        if due:
            self._check_finite(run)
        if logged:
            self._log_window(run)
        if step % cfg.eval_interval == 0:
            self._record_eval(run.draft, step, run.history, run.metrics_file, run.curves)
            run.history.stop_reason = early_stop_reason(run.history.evals, cfg.early_stop)
            if run.history.stop_reason:
                log.info("stopping early: %s", run.history.stop_reason)
        if step % cfg.save_interval == 0:
            self._save_run(run, self._summary(run))
        if logged:  # the next window's tokens/s counts training, not this step's evaluation and save
            run.log_time = time.perf_counter()

    def _empty_window(self) -> torch.Tensor:
        return torch.zeros(self.positions, COUNT_FIELDS, dtype=torch.float64, device=self.device)  # [positions, 5]

    def _flops_per_token(self, draft) -> float | None:
        """The EAGLE-3 draft's training FLOPs per token (train/flops.py); None for DFlash (not counted yet)."""
        if self.config.family != "eagle3":
            return None
        seq_len = attention_length([self.source.lengths[i] for i in self.train_idx])
        return eagle3_train_flops(DraftShape.of(draft.config), ttt_steps=self.positions, seq_len=seq_len)

    def _utilisation(self, tokens: int, seconds: float, run: RunState) -> Utilisation | None:
        if run.flops_per_token is None:
            return None
        return utilisation(tokens, seconds, run.flops_per_token, device_name=self.device_name,
                           dtype=self.precision.name)

    def _log_window(self, run: RunState) -> None:
        position = run.position
        window = StepCounts.rows(run.window)  # the window's one read
        seconds = max(time.perf_counter() - run.log_time, 1e-9)
        tokens = position.tokens - run.log_tokens
        run.step_tokens, run.step_seconds = run.step_tokens + tokens, run.step_seconds + seconds
        row = {"step": position.step, "epoch": position.epoch, "lr": run.scheduler.get_last_lr()[0],
               "tokens": position.tokens, "tokens_per_s": round(tokens / seconds, 1),
               **summarize(window, weights=self.objective.weights)}
        use = self._utilisation(tokens, seconds, run)
        if use is not None:
            row["tflops"] = use.record()["tflops"]
            if use.mfu is not None:
                row["mfu"] = use.record()["mfu"]
        run.log_tokens = position.tokens
        speed = {"mfu": f"{100 * row['mfu']:.1f}%"} if "mfu" in row else {"tok/s": f"{row['tokens_per_s']:,.0f}"}
        run.bar.set_postfix(loss=f"{row['loss']:.3f}", **{f"acc{j}": f"{row[f'acc_{j}']:.2f}"
                                                       for j in range(min(3, self.positions))}, **speed)
        if run.metrics_file:
            run.metrics_file.write(json.dumps(row) + "\n")
            run.metrics_file.flush()
        if run.curves:
            run.curves.add("train", position.step, row)
        run.window = self._empty_window()

    def _finish_run(self, run: RunState) -> None:
        """A last evaluation (unless the last step had one) and the final checkpoint."""
        self._check_finite(run)
        evals = run.history.evals
        if not evals or evals[-1]["step"] != run.position.step:
            self._record_eval(run.draft, run.position.step, run.history, run.metrics_file, run.curves)
        run.history.seconds += time.perf_counter() - run.start
        run.start = time.perf_counter()
        self._save_run(run, self._summary(run, run.history.evals[-1]))

    def _summary(self, run: RunState, final_eval: dict | None = None) -> dict[str, Any]:
        """The ``training`` section of the draft's config.json."""
        cfg, history = self.config, run.history
        return {"target": cfg.target, "data": cfg.data or cfg.online_data, "steps": run.position.step,
                "train_tokens": run.position.tokens, "draft_vocab_coverage": round(run.coverage, 4),
                "heldout_sequence_ids": [self.val_source.sequence_ids[i] for i in self.val_idx],
                "config": cfg.identity(), "init_draft": self.init_lineage, "precision": self.precision.record(),
                "final_eval": final_eval or (history.evals[-1] if history.evals else {}),
                "seconds": round(history.seconds + time.perf_counter() - run.start, 1),
                **self._data_preset()}

    def _data_preset(self) -> dict[str, str]:
        """``data_preset``: the named data set the training data came from, which resolves on any machine
        (``presets.recorded_data``) where the recorded path does not."""
        from eaglewire.core.presets import DATA_PRESETS

        cfg = self.config
        name = (self.source.dataset.manifest["source"].get("data") if cfg.data is not None else cfg.online_data)
        return {"data_preset": name} if isinstance(name, str) and name in DATA_PRESETS else {}

    def _save_run(self, run: RunState, training_summary: dict[str, Any]) -> None:
        if self.rank != 0:
            return
        save_state(self.out, self.config, run)
        save_draft(self.out, run.draft, self.contract, training_summary)

    def _result(self, run: RunState) -> TrainResult:
        cfg, position = self.config, run.position
        return TrainResult(out=str(self.out), steps=position.step,
                           epochs_done=position.epoch + position.batch / max(1, run.per_epoch * cfg.grad_accum),
                           train_tokens=position.tokens, seconds=run.history.seconds,
                           final_eval=run.history.evals[-1], finished=not run.stopped_early,
                           timers={k: round(v, 2) for k, v in self.timers.items()},
                           throughput=self._throughput(run), stop_reason=run.history.stop_reason)

    def _throughput(self, run: RunState) -> dict[str, float | None]:
        """This run's training speed over its logged windows (evaluations and saves left out), logged once."""
        if not run.step_seconds:
            return {}
        use = self._utilisation(run.step_tokens, run.step_seconds, run)
        if use is None:
            log.info("train: %s tokens/s (MFU not counted for %s drafts)",
                     f"{run.step_tokens / run.step_seconds:,.0f}", self.config.family)
            return {"tokens_per_s": round(run.step_tokens / run.step_seconds, 1), "tflops": None, "mfu": None}
        if self.rank == 0:
            log.info("train: %s", use.describe())
        return use.record()

    def _sync_grads(self, draft: torch.nn.Module) -> None:
        """Data parallel: sum gradients over ranks (each rank's loss is already its share of the
        step's loss; the draft is one layer: plain all-reduce is as fast as DDP's buckets and keeps
        the step code identical)."""
        if self.world == 1:
            return
        for p in draft.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)

    def _record_eval(self, draft, step: int, history: History, metrics_file, curves: Curves | None = None) -> None:
        row = {"step": step, **self.evaluate(draft)}
        if curves:
            curves.add("eval", step, row)
        history.evals.append(row)
        log.info("step %d: %s", step, " ".join(f"{k}={v:.3f}" for k, v in row.items() if k != "step"))
        if metrics_file:
            metrics_file.write(json.dumps({"eval": True, **row}) + "\n")
            metrics_file.flush()

    def _plot(self) -> None:
        from eaglewire.core.plots import plot_training

        try:
            plot_training(self.out / METRICS_FILE, self.out / "training.png")
        except Exception as e:  # a plot must never fail a finished training run
            log.warning("could not draw training curves: %s", e)


def train(config: TrainConfig, *, target: Target | None = None, progress: bool = True) -> TrainResult:
    """Train a draft into ``config.out``, the only run writing there (rank 0 holds its lock;
    a second run gets DirectoryLocked)."""
    rank, _ = dist_rank_world()
    with directory_lock(config.out, what=f"--out {config.out}") if rank == 0 else nullcontext():
        return Trainer(config, target).run(progress=progress)
