"""Generated workloads: seeded request streams of the shapes serving engines meet.

``generate("docqa", seed=0)`` (or a spec with parameters, ``"agentic:sessions=60,tool_s=20"``)
returns ``list[TraceRequest]`` in arrival order, the form every trace loader returns, so the
replay (``python -m bench replay --workload docqa``), the simulator
(``python -m bench simulate --workload mix``) and ``python -m bench workloads NAME --out F``
(Mooncake-format JSONL for ``--trace F --mooncake-block-size 64``) all read them.

| name | shape | reuse it exercises |
|---|---|---|
| ``docqa`` | many questions on one long document, some with follow-ups | a fork at the document's end; chunk checkpoints along it |
| ``agentic`` | agent tool loops: a session returns after a tool call of seconds to minutes | long growing chains; the deepest state is what the next step needs |
| ``multiturn`` | multi-turn chats below a few system prompts | chains plus shared heads |
| ``sysprompt`` | one-off questions below a few long, Zipf-popular system prompts | only the shared heads; every end state is dead weight |
| ``toolcall`` | tool-call sessions below a few Zipf-popular system prompt + tool sets; heavy-tailed tool results and pauses | growing chains over shared heads; a session's latest state is what its next step needs, after seconds or minutes |
| ``mix`` | the four above, interleaved in one block space | all of it at once |

Parameters and their defaults are the fields of the ``*Params`` classes in
:mod:`bench.workloads.shapes`; ``mix`` takes one share per shape (``docqa=0.25, ...``),
scaling that shape's session count. Every generator uses 64-token blocks (``block=64``
changes it) and is deterministic for a given seed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from bench.cli import seed
from bench.traces.loader import TraceRequest
from bench.workloads.shapes import (
    AgenticParams,
    DocQAParams,
    MultiturnParams,
    SysPromptParams,
    ToolCallParams,
    agentic,
    check_parameter,
    docqa,
    multiturn,
    sysprompt,
    toolcall,
)
from bench.workloads.streams import BlockSpace, Stream

__all__ = [
    "WORKLOADS",
    "BlockSpace",
    "MixParams",
    "Stream",
    "Workload",
    "TRACE_FILE_OPTIONS",
    "add_workload_arguments",
    "check_source_options",
    "generate",
    "parse_spec",
    "workload_requests",
]

DEFAULT_BLOCK = 64
"""Tokens per trace block of the generated workloads (a divisor of common page sizes)."""


@dataclass(frozen=True)
class MixParams:
    """Shares of the four shapes, each scaling that shape's session count (0 drops it)."""

    docqa: float = 0.25
    agentic: float = 0.25
    multiturn: float = 0.25
    sysprompt: float = 0.25


@dataclass(frozen=True)
class Workload:
    """A registered generator: its parameter class and ``(params, seed, space) -> requests``."""

    name: str
    params: type
    build: Callable[[Any, int, BlockSpace], list[TraceRequest]]
    doc: str


_SCALED = {"docqa": "docs", "agentic": "sessions", "multiturn": "sessions",
           "sysprompt": "requests"}


def _mix(p: MixParams, seed: int, space: BlockSpace) -> list[TraceRequest]:
    out: list[TraceRequest] = []
    for i, name in enumerate(("docqa", "agentic", "multiturn", "sysprompt")):
        share = getattr(p, name)
        if share <= 0:
            continue
        w = WORKLOADS[name]
        base = w.params()
        count = getattr(base, _SCALED[name])
        part = replace(base, **{_SCALED[name]: max(1, round(count * share))})
        out.extend(w.build(part, seed * 16 + i + 1, space))
    return out


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload("docqa", DocQAParams, docqa, "many questions on one long document"),
        Workload("agentic", AgenticParams, agentic, "agent tool loops with tool latency"),
        Workload("multiturn", MultiturnParams, multiturn, "multi-turn chats"),
        Workload("sysprompt", SysPromptParams, sysprompt, "one-off requests, shared system prompts"),
        Workload("toolcall", ToolCallParams, toolcall,
                 "tool-call sessions, heavy-tailed results and pauses"),
        Workload("mix", MixParams, _mix, "the four shapes interleaved"),
    )
}


def _coerce(cls: type, name: str, text: str) -> Any:
    kinds = {f.name: f.type for f in fields(cls)}
    kind = kinds[name]
    try:
        if kind in ("int", int):
            v = float(text)
            if v != int(v):
                raise ValueError
            return int(v)
        return float(text)
    except ValueError:
        raise ValueError(f"workload parameter {name}={text!r} is not a {kind}") from None


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``"docqa:docs=20,questions=8"`` -> ``("docqa", {"docs": 20, "questions": 8.0})``.

    ``seed`` and ``block`` are accepted besides the shape's own parameters.

    Raises:
        ValueError: an unknown workload (the message lists them), an unknown parameter (the
            message lists the accepted ones), a malformed ``key=value`` or a bad number.
    """
    name, _, rest = spec.partition(":")
    name = name.strip()
    w = WORKLOADS.get(name)
    if w is None:
        raise ValueError(f"unknown workload {name!r}; expected one of {sorted(WORKLOADS)}")
    accepted = [f.name for f in fields(w.params)]
    out: dict[str, Any] = {}
    for item in filter(None, (x.strip() for x in rest.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep:
            raise ValueError(f"workload parameter {item!r} must be KEY=VALUE")
        if key in ("seed", "block"):
            try:
                out[key] = int(value)
            except ValueError:
                raise ValueError(f"workload parameter {key}={value!r} is not an int") from None
        elif key in accepted:
            out[key] = _coerce(w.params, key, value)
        else:
            raise ValueError(f"workload {name!r} has no parameter {key!r}; accepted: "
                             f"{', '.join(accepted + ['seed', 'block'])}")
    return name, out


def generate(spec: str, seed: int = 0, overrides: Mapping[str, Any] | None = None
             ) -> list[TraceRequest]:
    """The requests of workload ``spec`` (see :func:`parse_spec`), sorted by arrival time
    (stable), timestamps from 0. ``seed`` applies unless the spec sets one.

    Raises:
        ValueError: as :func:`parse_spec`; a negative count or a block size below 1.
    """
    name, kw = parse_spec(spec)
    kw.update(overrides or {})
    seed = int(kw.pop("seed", seed))
    block = int(kw.pop("block", DEFAULT_BLOCK))
    w = WORKLOADS[name]
    params = w.params(**kw)
    for f in fields(params):
        check_parameter(f.name, getattr(params, f.name))
    reqs = w.build(params, seed, BlockSpace(block))
    if not reqs:
        return reqs
    t0 = min(r.timestamp_s for r in reqs)
    reqs = sorted(reqs, key=lambda r: r.timestamp_s)
    return [replace(r, timestamp_s=r.timestamp_s - t0) for r in reqs]


def add_workload_arguments(parser: Any) -> None:
    """``--workload SPEC`` and ``--workload-seed N`` (an ``argparse`` parser): requests from a
    generator instead of ``--trace``."""
    parser.add_argument(
        "--workload", metavar="NAME[:k=v,...]", default=None,
        help=f"generated requests instead of --trace: one of {', '.join(WORKLOADS)} "
             "(python -m bench workloads --list shows the parameters)")
    parser.add_argument("--workload-seed", type=seed, default=None,
                        help="seed of --workload (default 0)")


#: The trace-file options (``argparse`` dest, their default) a command may have beside
#: ``--workload``: they read a file, so they have no meaning for generated requests.
TRACE_FILE_OPTIONS = {"trace_format": "auto", "mooncake_block_size": 512, "tracelab_block_size": 1}


def check_source_options(parser: Any, args: Any) -> None:
    """Stop with a one-line usage error when an option would be silently ignored: a trace-file
    option (:data:`TRACE_FILE_OPTIONS`, those the parser has) given with ``--workload``, or
    ``--workload-seed`` without it; then set the defaults of those not given (they default to
    ``None`` so that giving one can be told from not giving it)."""
    given = [f"--{dest.replace('_', '-')}" for dest in TRACE_FILE_OPTIONS
             if getattr(args, dest, None) is not None]
    if args.workload is not None and given:
        parser.error(f"{', '.join(given)} {'reads' if len(given) == 1 else 'read'} a trace "
                     "file, not --workload's generated requests (drop one or the other)")
    if args.workload is None and args.workload_seed is not None:
        parser.error("--workload-seed needs --workload, which is off (give --workload, or drop "
                     "--workload-seed)")
    if args.workload_seed is None:
        args.workload_seed = 0
    for dest, default in TRACE_FILE_OPTIONS.items():
        if hasattr(args, dest) and getattr(args, dest) is None:
            setattr(args, dest, default)


def workload_requests(spec: str, seed: int, max_requests: int | None,
                      trace: object = None) -> list[TraceRequest]:
    """The requests of ``--workload spec`` cut to ``max_requests``.

    Raises:
        ValueError: ``trace`` (``--trace``) was given too, or as :func:`generate`.
    """
    if trace is not None:
        raise ValueError("--trace and --workload are exclusive")
    reqs = generate(spec, seed=seed)
    return reqs if max_requests is None else reqs[:max_requests]
