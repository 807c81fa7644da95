"""Seeded generators of the workload shapes serving engines meet (:mod:`bench.workloads`).

Each generator turns a parameter object into requests in arrival order. Lengths are drawn
from clamped log-normal laws (``median``, ``sigma`` of the log, ``[lo, hi]``), counts from
geometric laws, gaps from exponential (arrivals) or log-normal (think time, tool latency)
laws. The stream model (:mod:`bench.workloads.streams`) makes a continuation share its whole
context token for token: turn ``k + 1`` of a chat is turn ``k``'s prompt, its answer and the
new message. The engine never caches output (the replay's engine model), so the answer is
prefilled again by the next turn, as in an engine that does not keep decode KV.

Shapes (a request's prompt, ``|`` = where later requests fork off)::

    docqa      [system | document | question (| answer | follow-up)...]
    agentic    [tools + system | task | call | tool result | call | tool result ...]
    multiturn  [system | user | answer | user | answer ...]
    toolcall   [system + tools | task | call | tool result | call | tool result ...]
    sysprompt  [system prompt (of a few, Zipf-popular) | one-off user message]

Time: every generator starts its sessions within ``span_s`` seconds (two to four minutes by
default: an engine under load, bursts of 16 and more requests in flight, so the
``--max-running-requests`` limit binds at 16 and the running requests pin state slots). A
session's next request comes after the previous one's decode time (``output x 20 ms``, the
simulator's default decode step) plus a think time (chat, document follow-ups) or a tool
latency (agent loops); the simulator also holds it until the previous one has finished.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from bench.traces.loader import TraceRequest
from bench.workloads.streams import BlockSpace, Stream

__all__ = [
    "AgenticParams",
    "DocQAParams",
    "MultiturnParams",
    "SysPromptParams",
    "ToolCallParams",
    "agentic",
    "check_parameter",
    "docqa",
    "multiturn",
    "sysprompt",
    "toolcall",
]

#: Parameters whose domain is narrower than "a number >= 0" (the same name means the same
#: thing in every shape): the mean of a geometric count 1, 2, ... (``_Draw.geometric``);
#: how many heads a Zipf draw picks among; a probability; a Pareto index (its inverse is an
#: exponent).
GEOMETRIC_MEANS = frozenset({"questions", "followups", "steps", "subagent_steps", "turns"})
POPULATIONS = frozenset({"systems", "toolsets"})
PROBABILITIES = frozenset({"followup_p", "subagent_p"})
PARETO_INDICES = frozenset({"result_alpha"})


def check_parameter(name: str, value: float) -> None:
    """``ValueError`` naming ``name`` when ``value`` is outside its domain: every parameter a
    finite number >= 0, and those above narrower (see :data:`GEOMETRIC_MEANS` ...)."""
    if not math.isfinite(value):
        raise ValueError(f"workload parameter {name} must be a finite number, got {value}")
    if value < 0:
        raise ValueError(f"workload parameter {name} must be >= 0, got {value}")
    if name in GEOMETRIC_MEANS and value < 1:
        raise ValueError(f"workload parameter {name} is the mean of a count 1, 2, ...: >= 1, "
                         f"got {value}")
    if name in POPULATIONS and value < 1:
        raise ValueError(f"workload parameter {name} is how many there are to draw from: "
                         f">= 1, got {value}")
    if name in PROBABILITIES and value > 1:
        raise ValueError(f"workload parameter {name} is a probability: in [0, 1], got {value}")
    if name in PARETO_INDICES and value <= 0:
        raise ValueError(f"workload parameter {name} is a Pareto index: > 0, got {value}")


DECODE_S = 0.020
"""Seconds per output token assumed when spacing a session's requests (the simulator's
default ``--decode-ms``)."""


class _Draw:
    """Clamped draws from one seeded generator."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def lognormal(self, median: float, sigma: float, lo: float, hi: float) -> int:
        v = median * float(np.exp(sigma * self.rng.standard_normal()))
        return int(round(min(max(v, lo), hi)))

    def seconds(self, median: float, sigma: float, lo: float, hi: float) -> float:
        v = median * float(np.exp(sigma * self.rng.standard_normal()))
        return min(max(v, lo), hi)

    def geometric(self, mean: float, hi: int) -> int:
        """1, 2, ... with the given mean (``mean >= 1``), at most ``hi``."""
        return min(int(self.rng.geometric(1.0 / mean)), hi)

    def exponential(self, mean: float) -> float:
        return float(self.rng.exponential(mean))

    def uniform(self, lo: float, hi: float) -> float:
        return float(self.rng.uniform(lo, hi))

    def chance(self, p: float) -> bool:
        return bool(self.rng.random() < p)

    def pareto(self, lo: float, alpha: float, hi: float) -> int:
        """A Pareto (type I) draw: ``P(X > x) = (lo / x) ** alpha`` for ``x >= lo``, clamped
        to ``hi`` and rounded."""
        v = lo * (1.0 - float(self.rng.random())) ** (-1.0 / alpha)
        return int(round(min(v, hi)))

    def zipf_index(self, n: int, s: float) -> int:
        w = 1.0 / np.arange(1, n + 1) ** s
        return int(self.rng.choice(n, p=w / w.sum()))


def _whole(space: BlockSpace, draw: _Draw, median: float, sigma: float, lo: float,
           hi: float) -> int:
    """A drawn length rounded down to whole blocks (at least one): a segment later requests
    fork after must end on a block boundary."""
    n = draw.lognormal(median, sigma, lo, hi)
    b = space.block_size
    return max(b, n // b * b)


def _blocks_of(space: BlockSpace, draw: _Draw, median: float, sigma: float,
               lo: float, hi: float) -> Stream:
    """A fresh stream of whole blocks (a shared segment later requests fork after)."""
    return space.stream(_whole(space, draw, median, sigma, lo, hi))


# ----------------------------------------------------------------------------- docqa
@dataclass(frozen=True)
class DocQAParams:
    """Many questions on one long document (retrieval QA over an uploaded file).

    ``docs`` documents arrive uniformly over ``span_s``; each gets a geometric number of
    questions (mean ``questions``) at exponential gaps (mean ``question_gap_s``); a question
    gets follow-up turns with probability ``followup_p`` (geometric count, mean
    ``followups``), each after a think time (median ``think_s``). All documents sit below one
    shared system prompt of ``system_tokens``.
    """

    docs: int = 64
    doc_median: int = 32_000
    doc_sigma: float = 0.7
    doc_max: int = 128_000
    questions: float = 10.0
    question_gap_s: float = 12.0
    question_median: int = 80
    answer_median: int = 250
    followup_p: float = 0.35
    followups: float = 1.6
    think_s: float = 20.0
    system_tokens: int = 768
    span_s: float = 120.0


def docqa(p: DocQAParams, seed: int, space: BlockSpace) -> list[TraceRequest]:
    draw = _Draw(seed)
    system = space.stream(p.system_tokens // space.block_size * space.block_size)
    out: list[TraceRequest] = []
    for d in range(p.docs):
        doc = system.fork()
        doc.append(_whole(space, draw, p.doc_median, p.doc_sigma, 2_000, p.doc_max))
        t = draw.uniform(0.0, p.span_s)
        for q in range(draw.geometric(p.questions, 200)):
            t += draw.exponential(p.question_gap_s) if q else 0.0
            chat = doc.fork()
            chat.append(draw.lognormal(p.question_median, 0.8, 8, 1_500))
            ans = draw.lognormal(p.answer_median, 0.6, 16, 2_000)
            out.append(chat.request(t, ans, f"doc{d}"))
            turns = draw.geometric(p.followups, 12) if draw.chance(p.followup_p) else 0
            tt = t
            for _ in range(turns):
                tt += ans * DECODE_S + draw.seconds(p.think_s, 0.8, 3.0, 900.0)
                chat.append(ans + draw.lognormal(p.question_median, 0.8, 8, 1_500))
                ans = draw.lognormal(p.answer_median, 0.6, 16, 2_000)
                out.append(chat.request(tt, ans, f"doc{d}"))
    return out


# --------------------------------------------------------------------------- agentic
@dataclass(frozen=True)
class AgenticParams:
    """Agent tool loops (coding agents, deep research): a session appends a tool call and its
    result per step and comes back after the tool ran (seconds to minutes).

    ``sessions`` start uniformly over ``span_s`` below one of ``toolsets`` shared tool /
    system prompts (Zipf 1.0). Steps per session: geometric, mean ``steps``. Each step's
    call is the previous answer (median ``call_median`` tokens); the tool result has median
    ``result_median`` tokens; the tool latency has median ``tool_s`` (clamped to 0.5 s - 10
    min). With probability ``subagent_p`` a step also spawns a sub-agent that forks the
    context and runs ``subagent_steps`` (mean) steps of its own.
    """

    sessions: int = 80
    toolsets: int = 3
    toolset_median: int = 6_000
    task_median: int = 1_200
    steps: float = 12.0
    call_median: int = 180
    result_median: int = 1_500
    tool_s: float = 8.0
    subagent_p: float = 0.04
    subagent_steps: float = 5.0
    max_context: int = 120_000
    span_s: float = 120.0


def _agent_run(p: AgenticParams, draw: _Draw, ctx: Stream, t: float, steps: int,
               name: str, out: list[TraceRequest]) -> None:
    for _ in range(steps):
        if ctx.length >= p.max_context:
            return
        call = draw.lognormal(p.call_median, 0.7, 16, 2_000)
        out.append(ctx.request(t, call, name))
        if draw.chance(p.subagent_p):
            sub = ctx.fork()
            sub.append(draw.lognormal(p.task_median / 2, 0.6, 32, 4_000))
            _agent_run(p, draw, sub, t + call * DECODE_S + 1.0,
                       draw.geometric(p.subagent_steps, 30), name + "/sub", out)
        ctx.append(call + draw.lognormal(p.result_median, 1.1, 8, 16_000))
        t += call * DECODE_S + draw.seconds(p.tool_s, 1.2, 0.5, 600.0)


def agentic(p: AgenticParams, seed: int, space: BlockSpace) -> list[TraceRequest]:
    draw = _Draw(seed)
    toolsets = [_blocks_of(space, draw, p.toolset_median, 0.4, 1_000, 20_000)
                for _ in range(p.toolsets)]
    out: list[TraceRequest] = []
    for s in range(p.sessions):
        ctx = toolsets[draw.zipf_index(p.toolsets, 1.0)].fork()
        ctx.append(draw.lognormal(p.task_median, 0.8, 32, 8_000))
        _agent_run(p, draw, ctx, draw.uniform(0.0, p.span_s), draw.geometric(p.steps, 120),
                   f"agent{s}", out)
    return out


# ------------------------------------------------------------------------- multiturn
@dataclass(frozen=True)
class MultiturnParams:
    """Multi-turn chats: ``sessions`` start as a Poisson process over ``span_s``, each below
    one of ``systems`` system prompts (Zipf 1.0, median ``system_median`` tokens), with a
    geometric number of turns (mean ``turns``) separated by think times (median
    ``think_s``); user messages median ``user_median``, answers median ``answer_median``."""

    sessions: int = 160
    systems: int = 6
    system_median: int = 1_500
    turns: float = 6.0
    user_median: int = 200
    answer_median: int = 350
    think_s: float = 30.0
    span_s: float = 120.0


def multiturn(p: MultiturnParams, seed: int, space: BlockSpace) -> list[TraceRequest]:
    draw = _Draw(seed)
    systems = [_blocks_of(space, draw, p.system_median, 0.6, 128, 8_000) for _ in range(p.systems)]
    out: list[TraceRequest] = []
    for s in range(p.sessions):
        chat = systems[draw.zipf_index(p.systems, 1.0)].fork()
        t = draw.uniform(0.0, p.span_s)
        ans = 0
        for k in range(draw.geometric(p.turns, 60)):
            if k:
                t += ans * DECODE_S + draw.seconds(p.think_s, 0.9, 2.0, 1_200.0)
            chat.append(ans + draw.lognormal(p.user_median, 1.0, 4, 6_000))
            ans = draw.lognormal(p.answer_median, 0.7, 8, 3_000)
            out.append(chat.request(t, ans, f"chat{s}"))
    return out


# ------------------------------------------------------------------------- sysprompt
@dataclass(frozen=True)
class SysPromptParams:
    """Single-turn requests below a few long shared system prompts (an API product with a
    handful of applications): ``requests`` Poisson arrivals over ``span_s``, ``systems``
    prompts (median ``system_median`` tokens, Zipf ``skew`` popularity), each with
    ``fewshot`` variants of an example block after it (a second fork level), and a one-off
    user message (median ``user_median``)."""

    requests: int = 1_200
    systems: int = 12
    system_median: int = 6_000
    skew: float = 1.0
    fewshot: int = 3
    fewshot_median: int = 1_500
    user_median: int = 400
    answer_median: int = 200
    span_s: float = 240.0


def sysprompt(p: SysPromptParams, seed: int, space: BlockSpace) -> list[TraceRequest]:
    draw = _Draw(seed)
    heads = []
    for _ in range(p.systems):
        sys_s = _blocks_of(space, draw, p.system_median, 0.6, 256, 32_000)
        variants = []
        for _ in range(p.fewshot):
            v = sys_s.fork()
            v.append(_whole(space, draw, p.fewshot_median, 0.5, 64, 8_000))
            variants.append(v)
        heads.append(variants)
    out: list[TraceRequest] = []
    t = 0.0
    for i in range(p.requests):
        t += draw.exponential(p.span_s / p.requests)
        variants = heads[draw.zipf_index(p.systems, p.skew)]
        req = variants[draw.zipf_index(len(variants), 1.0)].fork()
        req.append(draw.lognormal(p.user_median, 1.0, 4, 8_000))
        out.append(req.request(t, draw.lognormal(p.answer_median, 0.7, 8, 2_000), f"req{i}"))
    return out


# -------------------------------------------------------------------------- toolcall
@dataclass(frozen=True)
class ToolCallParams:
    """Agentic tool-call sessions (function-calling agents): every step is one model call
    whose output is a tool call; the tool runs, and the next step's prompt is the previous
    prompt, that output and the tool's result.

    ``sessions`` start uniformly over ``span_s`` (so they interleave), each below one of
    ``systems`` shared system prompt + tool set heads (Zipf ``skew`` popularity, median
    ``system_median`` tokens, whole blocks) with a task message (median ``task_median``).
    Steps per session: geometric, mean ``steps``, until the context passes
    ``max_context``. Output (the call): log-normal, median ``call_median``. Tool result
    sizes are heavy-tailed: Pareto with minimum ``result_min`` tokens and index
    ``result_alpha``, clamped to ``result_max``. The pause between a step's end of decode
    and the next step's arrival (the tool's latency) is log-normal, median ``tool_s``, log
    sigma ``tool_sigma``, clamped to ``[0.1 s, tool_max_s]``: with the defaults most are
    seconds and 4.5 % exceed a minute (``1 - Phi(ln(60 / 4) / 1.6)``, the log-normal
    tail); 6.3 % of the results exceed 1,500 tokens (``(150 / 1500) ** 1.2``).
    """

    sessions: int = 160
    systems: int = 4
    skew: float = 1.0
    system_median: int = 4_000
    task_median: int = 500
    steps: float = 10.0
    call_median: int = 120
    result_min: int = 150
    result_alpha: float = 1.2
    result_max: int = 24_000
    tool_s: float = 4.0
    tool_sigma: float = 1.6
    tool_max_s: float = 1_800.0
    max_context: int = 100_000
    span_s: float = 300.0


def toolcall(p: ToolCallParams, seed: int, space: BlockSpace) -> list[TraceRequest]:
    draw = _Draw(seed)
    heads = [_blocks_of(space, draw, p.system_median, 0.5, 512, 16_000) for _ in range(p.systems)]
    out: list[TraceRequest] = []
    for s in range(p.sessions):
        ctx = heads[draw.zipf_index(p.systems, p.skew)].fork()
        ctx.append(draw.lognormal(p.task_median, 0.8, 16, 6_000))
        t = draw.uniform(0.0, p.span_s)
        for _ in range(draw.geometric(p.steps, 200)):
            if ctx.length >= p.max_context:
                break
            call = draw.lognormal(p.call_median, 0.7, 8, 2_000)
            out.append(ctx.request(t, call, f"tool{s}"))
            ctx.append(call + draw.pareto(p.result_min, p.result_alpha, p.result_max))
            t += call * DECODE_S + draw.seconds(p.tool_s, p.tool_sigma, 0.1, p.tool_max_s)
    return out


Generator = Callable[..., list[TraceRequest]]
