"""Greedy and teacher-forced runs of a DeepSeek-V4 model, and their comparison with oracles.

Everything here drives the model through its public transformers API (``generate``, and the
forward with a ``DynamicCache``); which attention runs is decided by the context the caller
sets up: :func:`~dsv4_attn.e2e.attention_route.route_attention` (our path),
:func:`~dsv4_attn.e2e.attention_route.simulate_kv_format` (the storage-matched oracle: HF eager
attention on the rows our cache stores), or neither (HF eager attention: the oracle).

Why teacher-forced logits carry the assertions: a random-weight model has nearly Gaussian logits,
so over 80 greedy steps the top-2 margin regularly falls below 1e-3, while any bf16 rounding
anywhere in the loop moves logits by ~4e-3 (measured). Free-running greedy tokens then diverge
at such near-ties even when both runs are correct. If the teacher-forced logits differ by at most
``E`` everywhere, greedy tokens can only differ where the reference's top-2 margin is below
``2 E``; :meth:`GreedyAgreement.consistent_with` checks exactly that.

Token identity is therefore measured per step as well: teacher-forced over a reference run's own
greedy tokens, our path sees that run's history at every step, and
:attr:`LogitAgreement.matching_steps` counts the steps at which it picks the same token: a
near-tie then costs one step instead of the rest of the run. (With every logit within ``E`` such
a step necessarily has a reference margin below ``2 E``: the logit bound carries the assertion.)
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from dsv4_attn.e2e.attention_route import RouteStats, route_attention, simulate_kv_format
from dsv4_attn.kv_cache import KVFormat

__all__ = [
    "CASE_SEED",
    "NEW_TOKENS",
    "PROMPT_LEN",
    "FormatReport",
    "Generation",
    "GreedyAgreement",
    "LogitAgreement",
    "OracleRun",
    "compare_greedy",
    "compare_logits",
    "greedy",
    "make_prompt",
    "run_format",
    "run_oracle",
    "teacher_forced",
    "top2_margin",
]

#: the model/prompt seed of the demo and the CPU/GPU tests: a run that is not degenerate (9
#: distinct greedy tokens; some seeds repeat one or two tokens throughout)
CASE_SEED = 4
PROMPT_LEN = 180  # > 128: the window evicts during prefill; 45 CSA entries vs top-k 16
NEW_TOKENS = 80  # positions up to 258: the second HCA entry is emitted at t = 255, in decode


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device(model) -> torch.device:
    return next(model.parameters()).device


def make_prompt(vocab_size: int, length: int = PROMPT_LEN, seed: int = 0) -> torch.Tensor:
    """Seeded random token ids ``int64 [1, length]`` on the CPU (never token 0, the pad id)."""
    if length < 1:
        raise ValueError(f"prompt length must be >= 1, got {length}")
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab_size, (1, length), generator=gen)


@dataclass
class Generation:
    """A greedy run: ``tokens`` int64 ``[n]`` and raw ``logits`` float32 ``[n, vocab]`` (CPU)."""

    tokens: torch.Tensor
    logits: torch.Tensor
    seconds: float  # wall time of ``generate`` (prefill + decode)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens.numel() / self.seconds if self.seconds > 0 else float("inf")


@torch.no_grad()
def greedy(model, prompt: torch.Tensor, new_tokens: int = NEW_TOKENS) -> Generation:
    """Greedy-decode ``new_tokens`` tokens after ``prompt`` (``[1, L]``) with ``model.generate``."""
    device = _device(model)
    prompt = prompt.to(device)
    _sync(device)
    start = time.perf_counter()
    out = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    _sync(device)
    seconds = time.perf_counter() - start
    tokens = out.sequences[0, prompt.shape[1] :].cpu()
    logits = torch.cat(out.logits, dim=0).float().cpu()
    return Generation(tokens, logits, seconds)


@torch.no_grad()
def teacher_forced(model, sequence: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Logits ``float32 [L - prompt_len, vocab]`` predicting ``sequence[prompt_len:]`` (CPU).

    The prompt is prefilled in one forward; every later token of ``sequence`` (``[1, L]``) is fed
    one at a time through the cache (the decode path), whatever the model would have chosen.
    """
    device = _device(model)
    sequence = sequence.to(device)
    total = sequence.shape[1]
    if not 0 < prompt_len < total:
        raise ValueError(f"prompt_len must lie in [1, {total - 1}], got {prompt_len}")
    out = model(input_ids=sequence[:, :prompt_len], use_cache=True, logits_to_keep=1)
    logits = [out.logits[0, -1]]
    past = out.past_key_values
    for i in range(prompt_len, total - 1):
        out = model(input_ids=sequence[:, i : i + 1], past_key_values=past, use_cache=True)
        logits.append(out.logits[0, -1])
        past = out.past_key_values
    return torch.stack(logits).float().cpu()


@dataclass(frozen=True)
class GreedyAgreement:
    """How a greedy run matches a reference greedy run over the same prompt."""

    identical: bool
    matching: int  # steps where the tokens agree
    total: int
    first_divergence: int | None  # first step where the tokens differ
    reference_margin: float | None  # reference's top-1 minus top-2 logit at that step
    max_logit_error: float  # max |logit difference| up to and including that step

    def consistent_with(self, max_logit_error: float) -> bool:
        """Whether the runs can differ given a logit error of at most ``max_logit_error``: they
        are identical, or first diverge where the reference margin is below twice that error."""
        return self.identical or self.reference_margin < 2.0 * max_logit_error

    def describe(self) -> str:
        """Compact: ``80/80 identical`` or ``68/80, split@25 (margin 0.0009)``."""
        if self.identical:
            return f"{self.total}/{self.total} identical"
        return (
            f"{self.matching}/{self.total}, split@{self.first_divergence} "
            f"(margin {self.reference_margin:.4f})"
        )


def compare_greedy(candidate: Generation, reference: Generation) -> GreedyAgreement:
    """Token-by-token agreement of two greedy runs over the same prompt."""
    if candidate.tokens.shape != reference.tokens.shape:
        raise ValueError(
            f"runs differ in length: {tuple(candidate.tokens.shape)} vs "
            f"{tuple(reference.tokens.shape)}"
        )
    differ = (candidate.tokens != reference.tokens).nonzero()
    first = int(differ[0]) if differ.numel() else None
    upto = reference.tokens.numel() if first is None else first + 1
    error = (candidate.logits[:upto] - reference.logits[:upto]).abs().max()
    margin = None
    if first is not None:
        margin = float(top2_margin(reference.logits[first : first + 1])[0])
    return GreedyAgreement(
        identical=first is None,
        matching=int((candidate.tokens == reference.tokens).sum()),
        total=reference.tokens.numel(),
        first_divergence=first,
        reference_margin=margin,
        max_logit_error=float(error),
    )


@dataclass(frozen=True)
class LogitAgreement:
    """Teacher-forced comparison of two logit sequences ``[n, vocab]`` over the same tokens.

    Both runs see the same history at every step, so ``top1`` is the fraction of steps at which
    they take the same greedy decision, with no cascade from an earlier difference.
    """

    top1: float  # fraction of positions whose argmax agrees
    max_error: float  # max |logit difference|
    mean_error: float  # mean |logit difference|
    reference_std: float  # standard deviation of the reference logits (for scale)
    positions: int
    differing_steps: tuple[int, ...] = ()  # positions whose argmax differs
    max_margin_at_difference: float | None = None  # largest reference top-2 margin among them

    @property
    def matching_steps(self) -> int:
        return self.positions - len(self.differing_steps)

    def describe(self) -> str:
        """Compact: ``top-1  98.8%, max 0.0044``."""
        return f"top-1 {100 * self.top1:5.1f}%, max {self.max_error:.4f}"

    def describe_steps(self) -> str:
        """Compact: ``80/80 steps`` or ``79/80 steps (margin <= 0.0005)``."""
        text = f"{self.matching_steps}/{self.positions} steps"
        if self.differing_steps:
            text += f" (margin <= {self.max_margin_at_difference:.4f})"
        return text


def top2_margin(logits: torch.Tensor) -> torch.Tensor:
    """Top-1 minus top-2 logit per row of ``logits [n, vocab]`` -> ``[n]``."""
    top2 = logits.float().topk(2, dim=-1).values
    return top2[:, 0] - top2[:, 1]


def compare_logits(candidate: torch.Tensor, reference: torch.Tensor) -> LogitAgreement:
    """Top-1 agreement, differing steps and logit errors of ``candidate`` against ``reference``."""
    if candidate.shape != reference.shape:
        raise ValueError(f"shapes differ: {tuple(candidate.shape)} vs {tuple(reference.shape)}")
    diff = (candidate.float() - reference.float()).abs()
    same = candidate.argmax(dim=-1) == reference.argmax(dim=-1)
    differing = (~same).nonzero().flatten()
    margin = None
    if differing.numel():
        margin = float(top2_margin(reference[differing]).max())
    return LogitAgreement(
        top1=float(same.float().mean()),
        max_error=float(diff.max()),
        mean_error=float(diff.mean()),
        reference_std=float(reference.float().std()),
        positions=reference.shape[0],
        differing_steps=tuple(differing.tolist()),
        max_margin_at_difference=margin,
    )


@dataclass
class OracleRun:
    """HF eager attention on ``prompt``: its greedy run and its teacher-forced logits on the
    sequence it generated (``sequence`` = prompt + generated tokens, ``[1, L]``)."""

    prompt: torch.Tensor
    greedy: Generation
    sequence: torch.Tensor
    logits: torch.Tensor


def run_oracle(model, prompt: torch.Tensor, new_tokens: int = NEW_TOKENS) -> OracleRun:
    """Greedy and teacher-forced runs with transformers' own eager attention."""
    if model.config._attn_implementation != "eager":
        raise ValueError(
            f"the oracle must run HF eager attention, the model is set to "
            f"{model.config._attn_implementation!r}"
        )
    run = greedy(model, prompt, new_tokens)
    sequence = torch.cat([prompt, run.tokens[None, :]], dim=1)
    return OracleRun(prompt, run, sequence, teacher_forced(model, sequence, prompt.shape[1]))


@dataclass
class FormatReport:
    """One KV-cache format: our path against the oracle and against the storage-matched oracle.

    ``tf_vs_oracle`` runs over the oracle's sequence. ``tf_vs_sim`` runs over the storage-matched
    oracle's own greedy sequence when it ran greedy (so its ``matching_steps`` counts the steps at
    which our path, given that oracle's history, picks that oracle's token), else over the
    oracle's sequence.
    """

    fmt: KVFormat
    ours: Generation  # our path, free-running greedy
    vs_oracle: GreedyAgreement
    tf_vs_oracle: LogitAgreement  # our path vs the oracle (the format's effect + ours)
    stats: RouteStats  # what ran during the greedy run
    tf_stats: RouteStats  # what ran during the teacher-forced runs
    sim: Generation | None = None  # storage-matched oracle, free-running greedy
    vs_sim: GreedyAgreement | None = None
    tf_vs_sim: LogitAgreement | None = None  # our path vs storage-matched oracle (ours only)
    tf_sim_vs_oracle: LogitAgreement | None = None  # the format's own effect (oracle's sequence)
    #: whether the storage-matched oracle, teacher-forced over its own greedy tokens, picks them
    #: again (the premise of reading ``tf_vs_sim`` as per-step token identity)
    sim_teacher_forcing_reproduces_greedy: bool | None = None


def run_format(
    model,
    oracle: OracleRun,
    fmt: KVFormat | str,
    backend: str = "auto",
    sim_greedy: bool = True,
    sim_teacher_forced: bool = True,
    ours_greedy: bool = True,
    check_mask: bool = False,
    seed: int = 0,
) -> FormatReport:
    """Our path (``dsv4_attn.ops`` over paged caches in ``fmt``) against ``oracle``.

    Runs our path greedy (``ours_greedy``; else ``ours``/``vs_oracle`` hold the oracle's
    tokens and a trivial agreement) and teacher-forced over the oracle's sequence, and the
    storage-matched oracle (HF eager on rows round-tripped through ``fmt``, q and output in bf16
    like ours) greedy and/or teacher-forced as asked. With both ``sim_greedy`` and
    ``sim_teacher_forced``, our path and the storage-matched oracle are also teacher-forced over
    the latter's greedy sequence (see :class:`FormatReport`).
    """
    fmt = KVFormat.parse(fmt)
    prompt, prompt_len = oracle.prompt, oracle.prompt.shape[1]
    new_tokens = oracle.greedy.tokens.numel()
    sim = sim_tf = None
    sim_sequence = oracle.sequence
    if sim_greedy or sim_teacher_forced:
        with simulate_kv_format(model, fmt):
            if sim_greedy:
                sim = greedy(model, prompt, new_tokens)
                sim_sequence = torch.cat([prompt, sim.tokens[None, :]], dim=1)
            if sim_teacher_forced:
                sim_tf = teacher_forced(model, sim_sequence, prompt_len)
    route_args = dict(fmt=fmt, backend=backend, check_mask=check_mask, seed=seed)
    with route_attention(model, **route_args) as route:
        ours = greedy(model, prompt, new_tokens) if ours_greedy else oracle.greedy
    with route_attention(model, **route_args) as tf_route:  # a new sequence resets the caches
        ours_tf = teacher_forced(model, oracle.sequence, prompt_len)
        # Over the storage-matched oracle's own tokens; the same run when they are the oracle's.
        ours_on_sim = ours_tf
        if sim_tf is not None and not torch.equal(sim_sequence, oracle.sequence):
            ours_on_sim = teacher_forced(model, sim_sequence, prompt_len)
    report = FormatReport(
        fmt=fmt,
        ours=ours,
        vs_oracle=compare_greedy(ours, oracle.greedy),
        tf_vs_oracle=compare_logits(ours_tf, oracle.logits),
        stats=route.stats,
        tf_stats=tf_route.stats,
    )
    if sim is not None:
        report.sim, report.vs_sim = sim, compare_greedy(ours, sim)
    if sim_tf is not None:
        report.tf_vs_sim = compare_logits(ours_on_sim, sim_tf)
        if sim is None:
            report.tf_sim_vs_oracle = compare_logits(sim_tf, oracle.logits)
        else:
            reproduced = torch.equal(sim_tf.argmax(dim=-1), sim.tokens)
            report.sim_teacher_forcing_reproduces_greedy = reproduced
    return report
