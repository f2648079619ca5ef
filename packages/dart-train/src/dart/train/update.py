"""The RL update, written once over :class:`~dart.train.interface.TrainerBackend`: epochs, mini-batches,
micro-batches, loss aggregation and high-entropy step selection.

One batch goes through:

1. **``logp_old`` pass** (no gradient, before any update): every sample's log-probs under its own
   sampling distribution (``TrainingSample.sampling``) and exact per-token entropies from the trainer's
   full logits. Spread over data-parallel ranks, then gathered so every rank holds all of them. Where the
   batch is one optimizer step over every sample (``ppo_epochs`` 1, ``mini_batches`` 1,
   ``entropy_top_fraction`` 1: the defaults) there is no such pass: the policy has not moved before that
   step, so its own forward pass gives the same numbers (kept detached, gathered after it), and each
   sample's forward pass runs once, not twice.
2. **Selection**: the ``entropy_top_fraction`` of steps with the highest mean entropy (per batch or per
   trajectory); the others are not trained on.
3. **Token weights**: ``token_mean`` or ``trajectory_mean`` over all the selected steps of the batch
   (see :class:`~dart.train.config.TrainerConfig`), so a trajectory's share does not depend on how its
   steps fall into mini-batches.
4. **``ppo_epochs`` x ``mini_batches`` optimizer steps**: each mini-batch keeps its samples' batch-wide
   weights times ``mini_batches`` (so a mini-batch's weights sum to about 1 and the step size does not
   shrink with more mini-batches), its samples are spread over data-parallel ranks and cut into
   micro-batches, gradients of the weighted-sum loss accumulate, then :meth:`optimizer_step`. From the
   second step on the policy is no longer the one ``logp_old`` came from, so ratios leave 1 and
   clipping acts.

Every rank makes the same number of forward/backward calls (FSDP all-gathers parameters inside them):
a rank short of samples runs a dummy row with weight 0. Each sample is one unpadded row (with ``train.packing`` a
micro-batch's rows are one packed pass, :mod:`dart.train.packing`, each row still attending to itself), and the
loss is a weighted sum, so neither padding, packing nor micro-batching changes the result.

A failure on one rank is every rank's (:mod:`dart.train.lockstep`): after each row's forward pass and each
micro-batch's backward the ranks agree on a status, so all of them stop at the same point. The failed
mini-batch's gradients are cleared and nothing of it is applied. Where every failing rank ran out of memory,
the mini-batch runs again at half the micro-batch size (down to 1; the rest of the batch keeps the smaller
size, the next batch starts at ``micro_batch_size`` again); each retry is recorded in
:attr:`TrainStepMetrics.retried`. Otherwise, or out of memory at size 1, every rank raises the same
:class:`~dart.train.errors.RankFailureError`.

Each sample belongs to one data-parallel rank (:func:`owners_of`), which alone needs its inputs: it computes
the sample's ``logp_old`` and its share of every mini-batch. Blocks of ``min(mini_batches, n)`` consecutive
samples are dealt to the ranks in turn and each rank deals its chosen samples to the mini-batches in turn,
so each mini-batch is spread evenly over the ranks (with every sample chosen it is exactly the mini-batch
``chosen[k::mini_batches]`` split round-robin).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

import torch

from dart.protocol.messages import TrainingSample
from dart.train import collectives
from dart.train.admission import admissible
from dart.train.batching import ImageSource, InputBuilder, ModelInputs, StoreImageSource, decode_screenshot, pad_rows
from dart.train.config import TrainerConfig
from dart.train.errors import RankFailureError, SampleError, TrainerError
from dart.train.lockstep import together
from dart.train.loss import grpo_loss

log = logging.getLogger("dart.train")


@dataclass(frozen=True)
class Retry:
    """A mini-batch run again at a smaller micro-batch size after a rank ran out of memory.

    Attributes:
        rank: The (lowest) rank that ran out of memory.
        reason: Why (``out_of_memory``).
        from_size: The micro-batch size that failed.
        to_size: The size it ran again at (half, at least 1).
    """

    rank: int
    reason: str
    from_size: int
    to_size: int


@dataclass(frozen=True)
class TrainStepMetrics:
    """What one batch's update did (figures averaged over its optimizer steps unless said otherwise).

    Attributes:
        step: Optimizer steps taken so far, this batch's included.
        loss: Mean over optimizer steps of the mini-batch's weighted GRPO loss.
        clip_fraction: Token-weighted fraction of tokens whose clipped term was the one chosen (no gradient).
        ratio_mean: Token-weighted mean of ``exp(logp - logp_old)`` (1 on a batch's first step).
        tis_weight_mean: Token-weighted mean off-policy correction weight.
        tis_truncated_fraction: Fraction of tokens whose weight was truncated (tis) or dropped (decoupled).
        grad_norm: Mean pre-clip global gradient L2 norm.
        tokens: Response tokens of the batch (all samples trained on).
        samples: Samples trained on (the batch's, less the refused ones).
        rollout_mismatch: Token-mean ``|logp_old - logp_rollout|`` in nats over the batch: engine-vs-trainer
            numerics plus policy lag; near 0 for on-policy data served by the same weights.
        rollout_mismatch_max: The batch's largest ``|logp_old - logp_rollout|`` of one token, nats: one token the
            engine and the trainer disagree on shows here, where the mean would hide it.
        entropy: Token-mean exact entropy of the policy on the batch's response tokens, nats.
        advantage_mean: Mean sample advantage.
        duration_s: Wall time of the update, seconds.
        kl: k3 estimate of KL(policy || reference), when ``loss.kl_coef > 0``.
        optimizer_steps: Optimizer steps taken on this batch (``ppo_epochs * mini_batches``).
        selected_samples: Samples trained on after high-entropy selection.
        refused_samples: Samples refused for a non-finite or out-of-bounds advantage or log-prob
            (:mod:`dart.train.admission`).
        dropped_samples: Samples dropped as unusable before the update (:mod:`dart.train.shares`).
        dropped_by_reason: The same, by reason (not in :meth:`as_dict`: the service reports it per reason).
        micro_batch_size: The micro-batch size the batch finished at: ``train.micro_batch_size``, or less
            after an out-of-memory retry (0 where not recorded).
        retried: The out-of-memory retries of this batch, in order (not in :meth:`as_dict`: the service
            reports each).
    """

    step: int
    loss: float
    clip_fraction: float
    ratio_mean: float
    tis_weight_mean: float
    tis_truncated_fraction: float
    grad_norm: float
    tokens: int
    samples: int
    rollout_mismatch: float
    entropy: float
    advantage_mean: float
    duration_s: float
    rollout_mismatch_max: float = 0.0
    kl: float | None = None
    optimizer_steps: int = 1
    selected_samples: int = 0
    refused_samples: int = 0
    dropped_samples: int = 0
    dropped_by_reason: dict[str, int] = field(default_factory=dict)
    micro_batch_size: int = 0
    retried: tuple[Retry, ...] = ()

    def as_dict(self) -> dict[str, float | int | None]:
        """Plain dict of the scalar figures, for telemetry events."""
        figures = asdict(self)
        del figures["dropped_by_reason"], figures["retried"]
        return figures


def select_high_entropy(
    samples: Sequence[TrainingSample], entropies: Sequence[float], fraction: float, scope: str = "batch"
) -> list[int]:
    """Indices of the ``fraction`` of samples with the highest mean entropy, in their original order.

    ``ceil(fraction * n)`` are kept (at least one); ``trajectory`` ranks within each trajectory so every
    trajectory keeps its own most uncertain steps. Ties go to the earlier step (deterministic).
    """
    if fraction >= 1.0 or not samples:
        return list(range(len(samples)))
    groups: dict[str, list[int]] = {}
    for i, s in enumerate(samples):
        groups.setdefault(s.trajectory_id if scope == "trajectory" else "", []).append(i)
    keep: set[int] = set()
    for idx in groups.values():
        n = math.ceil(fraction * len(idx))
        keep.update(sorted(idx, key=lambda i: (-entropies[i], i))[:n])
    return sorted(keep)


def token_weights(samples: Sequence[TrainingSample], lengths: Sequence[int], aggregation: str) -> list[float]:
    """Weight of each token of each sample; the weights of all tokens sum to 1."""
    if aggregation == "token_mean":
        total = sum(lengths)
        return [1.0 / total] * len(samples)
    per_traj: dict[str, int] = {}
    for s, n in zip(samples, lengths, strict=True):
        per_traj[s.trajectory_id] = per_traj.get(s.trajectory_id, 0) + n
    return [1.0 / (len(per_traj) * per_traj[s.trajectory_id]) for s in samples]


def owners_of(n: int, mini_batches: int, dp_size: int) -> list[int]:
    """The data-parallel rank that owns each of ``n`` samples (builds its inputs and computes it): blocks of
    ``min(mini_batches, n)`` consecutive samples, dealt to the ranks in turn."""
    block = max(1, min(mini_batches, n))
    return [(p // block) % dp_size for p in range(n)]


def mini_batches(chosen: Sequence[int], owners: Sequence[int], n_mini: int, dp_size: int) -> list[list[int]]:
    """``chosen`` split into ``n_mini`` mini-batches (sorted indices): each rank deals its own chosen samples to
    the mini-batches in turn, so each mini-batch's work is spread evenly over the ranks."""
    per_rank = [[i for i in chosen if owners[i] == r] for r in range(dp_size)]
    return [sorted(i for own in per_rank for i in own[k::n_mini]) for k in range(n_mini)]


def _shard(indices: Sequence[int], owners: Sequence[int], dp_rank: int, dp_size: int) -> list[int | None]:
    """This rank's ``indices`` (by ``owners``), padded with None so every rank gets the same count."""
    counts = [0] * dp_size
    for i in indices:
        counts[owners[i]] += 1
    mine: list[int | None] = [i for i in indices if owners[i] == dp_rank]
    return mine + [None] * (max(counts) - len(mine))


class SampleReader:
    """Rebuilds a recorded sample's model inputs: its exact tokens and the images its prompt was fed,
    fetched by reference and decoded as they were fed (the record carries the pixels; no rule is re-derived).

    Backend-independent: it needs only the checkpoint's processor and config, so the trainer service uses
    it with any :class:`~dart.train.interface.TrainerBackend`.

    Args:
        config: Trainer configuration (its ``model_path`` gives the processor).
        image_source: Reads screenshot references (default: local ``file://`` URIs only).
        processor: An already loaded processor of the checkpoint (loaded from ``model_path`` when None).
    """

    def __init__(
        self, config: TrainerConfig, image_source: ImageSource | None = None, *, processor: Any = None
    ) -> None:
        from transformers import AutoConfig, AutoProcessor

        if processor is None:
            processor = AutoProcessor.from_pretrained(config.model_path, local_files_only=True)  # type: ignore[no-untyped-call]  # an unannotated transformers API
        model_config = AutoConfig.from_pretrained(config.model_path, local_files_only=True)
        vision = getattr(model_config, "vision_config", None)
        self.image_source: ImageSource = image_source or StoreImageSource()
        self.builder = InputBuilder(
            processor,
            image_token_id=int(model_config.image_token_id),
            merge_size=int(getattr(vision, "spatial_merge_size", 2)),
        )

    def __call__(self, sample: TrainingSample) -> ModelInputs:
        """Inputs of one sample.

        Raises:
            SampleError: Tokens and images disagree.
            ImageFetchError: A screenshot cannot be read or fails its digest.
        """
        images = [decode_screenshot(self.image_source(ref), ref) for ref in sample.images]
        return self.builder.build(
            sample.prompt_token_ids,
            sample.response_token_ids,
            images,
            sample_id=(sample.trajectory_id, sample.step_index),
        )


@dataclass(frozen=True)
class _Held:
    """What one rank holds of a batch: ``inputs`` by sample index, each sample's ``owner`` rank, and the
    ``spare`` row it runs with weight 0 where it has no sample of its own."""

    inputs: Mapping[int, ModelInputs]
    owner: Sequence[int]
    spare: int


# What logp_old keeps of one sample: its log-probs, entropies and (with a KL term) reference log-probs, on the CPU.
_Old = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


class RLUpdate:
    """Runs one batch's update on a backend; see the module docstring for the steps.

    Args:
        backend: A :class:`~dart.train.interface.TrainerBackend`.
        config: Trainer configuration (epochs, mini-batches, micro-batch size, aggregation, selection, loss).
    """

    def __init__(self, backend: Any, config: TrainerConfig, *, one_pass: bool = True) -> None:
        self.backend = backend
        self.config = config
        self.loss_config = config.loss
        # Whether a batch that is one optimizer step over every sample takes logp_old from that step's own
        # forward pass (see the module docstring); False always runs the separate pass (tests compare the two).
        self.one_pass = one_pass and config.ppo_epochs == 1 and config.mini_batches == 1
        self.one_pass = self.one_pass and config.entropy_top_fraction >= 1.0

    @staticmethod
    def _sampling(sample: TrainingSample) -> dict[str, Any]:
        s = sample.sampling
        return {"temperature": s.temperature, "excluded_token_ids": s.excluded_token_ids, "top_p": s.top_p}

    # Gathers and sums run over the data-parallel group: with tensor parallelism the ranks of one TP group
    # hold the same per-sample figures, and the world is larger than the number of distinct shares.
    def run(
        self,
        samples: Sequence[TrainingSample],
        inputs: Sequence[ModelInputs] | Mapping[int, ModelInputs],
        owners: Sequence[int] | None = None,
    ) -> TrainStepMetrics:
        """Update on ``samples`` (every rank passes the same list) and return the batch's metrics.

        ``inputs`` holds at least the inputs of the samples this rank owns, by index (a list: every sample's);
        ``owners`` says which data-parallel rank owns each sample (default :func:`owners_of`). A rank that owns
        none of them still needs one sample's inputs: it runs that row with weight 0 to stay in step.

        Raises:
            TrainerError: No samples, or no inputs on this rank.
            SampleError: Every sample was refused (:mod:`dart.train.admission`).
            RankFailureError: A step failed on some rank (the same error on every rank; see the module
                docstring); optimizer steps of earlier mini-batches of the batch stand.
        """
        started = time.perf_counter()
        if not samples:
            raise TrainerError("an update needs at least one sample")
        cfg, backend = self.config, self.backend
        dp_size, dp_group = backend.dp_size, backend.dp_group
        samples, held, refused = self._admit(samples, inputs, owners)
        kl = self.loss_config.kl_coef > 0.0

        rollout = [torch.tensor(s.rollout_logprobs, dtype=torch.float32) for s in samples]
        lengths = [len(s.response_token_ids) for s in samples]
        total_tokens = sum(lengths)

        old, chosen, minis = self._plan(samples, held, lengths, kl)
        keys = ("loss", "clip_fraction", "ratio_mean", "tis_weight_mean", "tis_truncated_fraction") + (
            ("kl",) if kl else ()
        )
        sums = dict.fromkeys(keys, 0.0)
        norms: list[float] = []
        retried: list[Retry] = []
        mbs = cfg.micro_batch_size
        for _ in range(cfg.ppo_epochs):
            for mini in minis:
                step_sums, mbs = self._fitting(samples, held, mini, old, rollout, keys, mbs, retried)
                summed = collectives.sum_values(step_sums, size=dp_size, group=dp_group)
                for key, value in zip(keys, summed, strict=True):
                    sums[key] += value
                norms.append(backend.optimizer_step())
        if self.one_pass:
            old = self._gathered(old)
        n_steps = len(norms)
        gaps = [(old[i][0] - rollout[i]).abs() for i in range(len(samples))]
        mismatch = sum(float(g.sum()) for g in gaps) / total_tokens
        mismatch_max = max((float(g.max()) for g in gaps if g.numel()), default=0.0)
        entropy = sum(float(old[i][1].sum()) for i in range(len(samples))) / total_tokens
        return TrainStepMetrics(
            step=backend.step,
            loss=sums["loss"] / n_steps,
            clip_fraction=sums["clip_fraction"] / n_steps,
            ratio_mean=sums["ratio_mean"] / n_steps,
            tis_weight_mean=sums["tis_weight_mean"] / n_steps,
            tis_truncated_fraction=sums["tis_truncated_fraction"] / n_steps,
            grad_norm=sum(norms) / n_steps,
            tokens=total_tokens,
            samples=len(samples),
            rollout_mismatch=mismatch,
            rollout_mismatch_max=mismatch_max,
            entropy=entropy,
            advantage_mean=sum(s.advantage for s in samples) / len(samples),
            duration_s=time.perf_counter() - started,
            kl=sums["kl"] / n_steps if kl else None,
            optimizer_steps=n_steps,
            selected_samples=len(chosen),
            refused_samples=sum(refused.values()),
            micro_batch_size=mbs,
            retried=tuple(retried),
        )

    def _plan(
        self, samples: Sequence[TrainingSample], held: _Held, lengths: Sequence[int], kl: bool
    ) -> tuple[dict[int, _Old], list[int], list[dict[int, float]]]:
        """Steps 1-3: ``logp_old`` by sample index, the chosen samples, and each mini-batch's sample indices with
        their token weights. In one pass ``logp_old`` starts empty: :meth:`_mini_batch` fills this rank's rows."""
        cfg = self.config
        old: dict[int, _Old] = {}
        if self.one_pass:
            chosen = list(range(len(samples)))
        else:
            old = self._gathered(self._old_logprobs(samples, held, kl))
            mean_entropy = [float(old[i][1].mean()) if lengths[i] else 0.0 for i in range(len(samples))]
            chosen = select_high_entropy(samples, mean_entropy, cfg.entropy_top_fraction, cfg.entropy_scope)
        n_mini = min(cfg.mini_batches, len(chosen))
        weights = token_weights([samples[i] for i in chosen], [lengths[i] for i in chosen], cfg.loss_aggregation)
        weight_of = {i: w * n_mini for i, w in zip(chosen, weights, strict=True)}
        parts = mini_batches(chosen, held.owner, n_mini, self.backend.dp_size)
        return old, chosen, [{i: weight_of[i] for i in part} for part in parts]

    def _together(self, step: Any, what: str, micro_batch_size: int = 0) -> Any:
        """``step()`` on this rank, its outcome agreed by every rank (:func:`~dart.train.lockstep.together`)."""
        backend = self.backend
        return together(
            step, rank=backend.rank, world_size=backend.world_size, what=what, micro_batch_size=micro_batch_size
        )

    def _admit(
        self,
        samples: Sequence[TrainingSample],
        inputs: Sequence[ModelInputs] | Mapping[int, ModelInputs],
        owners: Sequence[int] | None,
    ) -> tuple[list[TrainingSample], _Held, dict[str, int]]:
        """The admitted samples (:mod:`dart.train.admission`), what this rank holds of them, and the refusals."""
        dp_rank, dp_size = self.backend.dp_rank, self.backend.dp_size
        inputs_of = dict(enumerate(inputs)) if isinstance(inputs, Sequence) else dict(inputs)
        owner = list(owners) if owners is not None else owners_of(len(samples), self.config.mini_batches, dp_size)
        keep, refused = admissible(samples, self.config.max_abs_advantage)
        if not keep:
            raise SampleError(samples[0].trajectory_id, samples[0].step_index, f"every sample refused: {dict(refused)}")
        if refused:
            log.warning("refusing %d samples of the batch: %s", sum(refused.values()), dict(refused))
            samples, owner = [samples[i] for i in keep], [owner[i] for i in keep]
            inputs_of = {new: inputs_of[old] for new, old in enumerate(keep) if old in inputs_of}
        if not inputs_of:  # the trainer's batches are admitted before their inputs are built: never there
            raise TrainerError(f"data-parallel rank {dp_rank} holds no admitted sample's inputs (one keeps it in step)")
        # A row this rank can run with weight 0 where it has no sample of its own.
        spare = min((i for i in inputs_of if owner[i] == dp_rank), default=min(inputs_of))
        return list(samples), _Held(inputs_of, owner, spare), dict(refused)

    def _old_logprobs(self, samples: Sequence[TrainingSample], held: _Held, kl: bool) -> dict[int, _Old]:
        """This rank's samples' ``logp_old``, entropies and (with ``kl``) reference log-probs, by sample index.

        Packed, ``logprob_micro_batch_size`` samples go in one pass; where every failing rank runs out of memory the
        pass runs again at half that size (down to 1). Unpacked, each sample is its own pass.

        Raises:
            RankFailureError: A pass failed on some rank for another reason, or out of memory at size 1.
        """
        backend, cfg = self.backend, self.config
        mine = _shard(range(len(samples)), held.owner, backend.dp_rank, backend.dp_size)
        size = (cfg.logprob_micro_batch_size or cfg.micro_batch_size) if cfg.packing else 1
        while True:
            try:
                local: dict[int, _Old] = {}
                with torch.no_grad():
                    for lo in range(0, len(mine), size):
                        rows = mine[lo : lo + size]
                        outs = self._forward(rows, held, samples, kl, "logp_old", size, keep=True)
                        local.update(
                            (i, row)
                            for i, (_, row) in zip(rows, outs, strict=True)
                            if i is not None and row is not None
                        )
                return local
            except RankFailureError as exc:
                if exc.reason != "out_of_memory" or size == 1:
                    raise
                smaller = max(1, size // 2)
                log.warning("rank %d: out of memory in the logp_old pass at %d samples; running it at %d",
                            backend.rank, size, smaller)  # fmt: skip
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                size = smaller

    def _gathered(self, local: dict[int, _Old]) -> dict[int, _Old]:
        """Every rank's ``local`` rows, gathered over the data-parallel group (every rank gets all of them)."""
        old: dict[int, _Old] = {}
        for part in collectives.gather_objects(local, size=self.backend.dp_size, group=self.backend.dp_group):
            old.update(part)
        return old

    def _forward(
        self,
        rows: Sequence[int | None],
        held: _Held,
        samples: Sequence[TrainingSample],
        kl: bool,
        what: str,
        mbs: int,
        *,
        keep: bool,
    ) -> list[tuple[torch.Tensor, _Old | None]]:
        """Forward passes of ``rows`` (None: the spare row, run for its collectives), each agreed by every rank:
        packed (``train.packing``) one pass for all of them, else one per row. ``keep``: also what ``logp_old``
        keeps of each row (see :meth:`_rows`)."""
        real = [held.spare if i is None else i for i in rows]
        if self.config.packing:
            return self._together(lambda: self._rows(real, held, samples, kl, keep), what, mbs)  # type: ignore[no-any-return]
        return [self._together(lambda i=i: self._rows([i], held, samples, kl, keep)[0], what, mbs) for i in real]

    def _rows(
        self, rows: Sequence[int], held: _Held, samples: Sequence[TrainingSample], kl: bool, keep: bool
    ) -> list[tuple[torch.Tensor, _Old | None]]:
        """Each row's log-probs (with gradient where autograd is on) and, with ``keep``, what ``logp_old`` keeps of it,
        on the CPU: the log-probs detached, the entropies and (with ``kl``) the reference log-probs. Without ``keep``
        nothing is copied off the device (a step whose ``logp_old`` came from its own pass)."""
        inputs = [held.inputs[i] for i in rows]
        samplings = [self._sampling(samples[i]) for i in rows]
        outs = self.backend.forward_logprobs_many(inputs, samplings)
        if not keep:
            return [(logp, None) for logp, _ in outs]
        refs: list[torch.Tensor | None] = [None] * len(rows)
        if kl:
            with torch.no_grad():
                refs = [r.float().cpu() for r in self.backend.reference_logprobs_many(inputs, samplings)]
        return [
            (logp, (logp.detach().float().cpu(), ent.detach().float().cpu(), ref))
            for (logp, ent), ref in zip(outs, refs, strict=True)
        ]

    def _fitting(
        self,
        samples: Sequence[TrainingSample],
        held: _Held,
        mini: dict[int, float],
        old: dict[int, _Old],
        rollout: Sequence[torch.Tensor],
        keys: Sequence[str],
        mbs: int,
        retried: list[Retry],
    ) -> tuple[list[float], int]:
        """One mini-batch's gradients at micro-batch size ``mbs``, run again at half the size (down to 1) while every
        failing rank runs out of memory; returns the metric sums and the size that fit (every rank alike).

        Raises:
            RankFailureError: Any other failure, or out of memory at size 1 (not retryable, naming the setting);
                the mini-batch's gradients are cleared.
        """
        backend = self.backend
        while True:
            try:
                return self._mini_batch(samples, held, mini, old, rollout, keys, mbs), mbs
            except RankFailureError as exc:
                backend.zero_grad()
                if exc.reason != "out_of_memory":
                    raise
                if mbs == 1:
                    raise RankFailureError(
                        exc.reason,
                        exc.rank,
                        exc.detail,
                        what=exc.what,
                        micro_batch_size=1,
                        retryable=False,
                        advice=f"; {self._too_large()}",
                    ) from exc
                smaller = max(1, mbs // 2)
                log.warning(
                    "rank %d: out of memory on rank %d at micro-batch size %d; running the mini-batch again at %d",
                    backend.rank,
                    exc.rank,
                    mbs,
                    smaller,
                )
                retried.append(Retry(rank=exc.rank, reason=exc.reason, from_size=mbs, to_size=smaller))
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()  # hand the failed attempt's cached blocks back before the retry
                mbs = smaller

    def _too_large(self) -> str:
        """What to do when one sample per micro-batch does not fit either."""
        size = self.config.micro_batch_size
        tried = (
            f"train.micro_batch_size {size} was halved down to 1 and" if size > 1 else "train.micro_batch_size is 1:"
        )
        return (
            f"{tried} one sample's forward and backward do not fit: give each rank more memory (more FSDP ranks, "
            "train.backend.mixed_precision bf16) or train on shorter samples"
        )

    def _mini_batch(
        self,
        samples: Sequence[TrainingSample],
        held: _Held,
        mini: dict[int, float],
        old: dict[int, _Old],
        rollout: Sequence[torch.Tensor],
        keys: Sequence[str],
        mbs: int,
    ) -> list[float]:
        """Accumulate one mini-batch's gradients on this rank at micro-batch size ``mbs``; returns this rank's
        weighted metric sums.

        ``mini`` maps the mini-batch's sample indices to their token weights (batch-wide, see the module
        docstring). Each row's forward and each micro-batch's loss and backward are agreed by every rank. In one
        pass (:attr:`one_pass`) each row's ``logp_old`` is its own forward pass's, recorded in ``old``.

        Raises:
            RankFailureError: A step failed on some rank (gradients are left for the caller to clear).
        """
        backend, dp_size, kl = self.backend, self.backend.dp_size, "kl" in keys
        mine = _shard(list(mini), held.owner, backend.dp_rank, dp_size)
        sums = dict.fromkeys(keys, 0.0)
        for lo in range(0, len(mine), mbs):
            rows = mine[lo : lo + mbs]
            real = [held.spare if i is None else i for i in rows]
            # In one pass this forward is also logp_old's (and the KL reference's); otherwise those were computed.
            outs = self._forward(rows, held, samples, kl, "micro-batch", mbs, keep=self.one_pass)
            if self.one_pass:
                olds = [row for _, row in outs if row is not None]
                old.update((i, row) for i, row in zip(rows, olds, strict=True) if i is not None)
            else:
                olds = [old[i] for i in real]
            logp, mask = pad_rows([out for out, _ in outs])
            device = logp.device
            logp_old = pad_rows([o[0] for o in olds])[0].to(device)
            roll = pad_rows([rollout[i] for i in real])[0].to(device)
            ref_rows = [o[2] for o in olds]
            ref = pad_rows([r for r in ref_rows if r is not None])[0].to(device) if kl else None
            adv = torch.tensor([samples[i].advantage for i in real], dtype=torch.float32, device=device)
            # Per-token weights ride in the mask; a padding row (None) weighs 0 but still runs its
            # forward/backward so every rank makes the same collective calls.
            row_w = torch.tensor([0.0 if i is None else mini[i] for i in rows], device=device)
            step = partial(self._backward, logp, logp_old, roll, adv, mask.to(device) * row_w[:, None], ref)
            metrics = self._together(step, "micro-batch", mbs)
            for key in keys:
                sums[key] += metrics[key]
        return [sums[k] for k in keys]

    def _backward(
        self,
        logp: torch.Tensor,
        logp_old: torch.Tensor,
        rollout: torch.Tensor,
        advantages: torch.Tensor,
        weights: torch.Tensor,
        ref: torch.Tensor | None,
    ) -> dict[str, float]:
        """One micro-batch's weighted-sum loss and its backward; returns the loss's metric sums."""
        loss, metrics = grpo_loss(logp, logp_old, rollout, advantages, weights, self.loss_config, ref, reduction="sum")
        # Data-parallel backends average gradients over ranks; the weights already cover the whole mini-batch,
        # so undo the average.
        (loss * self.backend.dp_size).backward()
        return metrics
