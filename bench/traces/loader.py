"""Request-trace loaders: JSONL trace files -> a list of :class:`TraceRequest`.

Three public formats are understood (detected from the first non-blank line, or forced with
``fmt=``):

``mooncake``
    ``{"timestamp": ms, "input_length", "output_length", "hash_ids": [...]}`` with one id per
    ``block_size``-token prompt block (512 for the Mooncake FAST'25 traces), and optionally
    ``"session"`` (a string or an integer: ``python -m bench workloads --out`` writes it).
    Block ``h`` of length ``n`` becomes the token ids ``h*B + 1 ... h*B + n``; the last block is partial
    (``input_length - B*(len(hash_ids) - 1)`` tokens), and
    ``len(hash_ids) == ceil(input_length / B)`` is checked on every line.
``gmi``
    LMBench's GMI trace: the same fields, but ``timestamp`` is a string of nanoseconds since
    the Unix epoch (the first request's time is subtracted) and the id chunk size is not
    stated. Every id is taken as exactly 32 tokens, so **``input_length`` is replaced by
    ``32 * len(hash_ids)``** (the file's own ``input_length`` does not match its ids on most
    lines; it is not used).
``tracelab``
    TraceLab's normalized round trace: one LLM call per line with ``session_id``,
    ``input_tokens_total``, ``prefix_tokens``, ``newly_append_tokens``, ``output_tokens`` and
    ``timing_events``. It has no block hashes, so each session is built as a chain: round
    ``k``'s prompt is the first ``prefix_tokens`` tokens of round ``k-1``'s prompt followed by
    ``newly_append_tokens`` fresh tokens that no other prompt contains (a session's first
    round is all fresh). The block size defaults to 1 (token counts are exact; no block
    structure is implied), so ``--end-checkpoint block`` and ``exact`` coincide for it.

Token ids are plain ``int``. A prompt is stored as a few ``(first_id, length)`` runs of
consecutive ids, so a 12,031-request trace holds kilobytes of token data, and
:attr:`TraceRequest.tokens` builds the id list in C (``list.extend(range(...))``), well under
a millisecond for a 126k-token prompt; :attr:`TraceRequest.token_array` builds the
``array('q')`` a cache key holds with numpy, about 60x faster (the replay uses it).
"""

from __future__ import annotations

import json
import math
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import numpy as np

__all__ = [
    "GMI_BLOCK_SIZE",
    "MOONCAKE_BLOCK_SIZE",
    "SHIPPED_TRACE",
    "TraceFormat",
    "TraceFormatError",
    "TraceRequest",
    "detect_format",
    "load_trace",
    "resolve_trace_path",
    "runs_from_blocks",
    "sniff_format",
    "trace_label",
]

TraceFormat = Literal["mooncake", "gmi", "tracelab"]

MOONCAKE_BLOCK_SIZE = 512
"""Tokens per hash id in the Mooncake traces."""

GMI_BLOCK_SIZE = 32
"""Tokens per hash id assumed for the LMBench GMI trace (the file does not state it)."""

SHIPPED_TRACE = (
    Path(__file__).resolve().parent / "mooncake_fast25_conversation_trace.jsonl"
)
"""The Mooncake conversation trace shipped with the project (see ``bench/traces/README.md``)."""


class TraceFormatError(ValueError):
    """A trace line is malformed; the message names the file and the 1-based line number."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace, with its prompt as deterministic token ids.

    Attributes:
        timestamp_s: arrival time in seconds since the trace's start.
        input_length: prompt length in tokens (equals ``len(self.tokens)``).
        output_length: generated tokens (no ids: output is never shared in these traces).
        block_size: tokens per trace block (512 Mooncake, 32 GMI, 1 TraceLab by default).
        block_ids: one id per block of the prompt, the last one possibly partial; equal
            sequences of leading ids mean equal leading content. Used by the bounds' trie.
        runs: the prompt as ``(first_token_id, length)`` runs of consecutive token ids.
        session: session id (TraceLab) or ``None``.
    """

    timestamp_s: float
    input_length: int
    output_length: int
    block_size: int
    block_ids: tuple[int, ...]
    runs: tuple[tuple[int, int], ...]
    session: str | None = None

    @property
    def num_full_blocks(self) -> int:
        """Whole trace blocks in the prompt: ``input_length // block_size``."""
        return self.input_length // self.block_size

    @property
    def tokens(self) -> list[int]:
        """The prompt's token ids, built on each access (O(input_length), in C)."""
        out: list[int] = []
        for first, length in self.runs:
            out.extend(range(first, first + length))
        return out

    @property
    def token_array(self) -> array:
        """The prompt's token ids as ``array('q')`` (what the cache keys hold), built on each
        access with numpy: about 1 ns/token, against ~60 ns/token for :attr:`tokens` plus the
        list's validation and conversion in ``RadixKey``."""
        out = array("q")  # ``frombytes`` reads the numpy buffer as bytes: one copy, not two
        if len(self.runs) == 1:
            first, length = self.runs[0]
            out.frombytes(np.arange(first, first + length, dtype=np.int64).data.cast("B"))
        elif self.runs:
            out.frombytes(np.concatenate(
                [np.arange(first, first + length, dtype=np.int64) for first, length in self.runs]
            ).data.cast("B"))
        return out


# --------------------------------------------------------------------------- helpers


def runs_from_blocks(
    hash_ids: list[int], block_size: int, input_length: int
) -> tuple[tuple[int, int], ...]:
    """Token runs for ``hash_ids`` (block ``h`` -> ids ``h*B+1 .. h*B+n``), merging neighbours.

    Consecutive ids ``h, h+1`` give contiguous token ranges, so a Mooncake prompt made of
    fresh blocks collapses into one run.
    """
    runs: list[list[int]] = []
    last = len(hash_ids) - 1
    for j, h in enumerate(hash_ids):
        n = block_size if j < last else input_length - block_size * last
        first = h * block_size + 1
        if runs and runs[-1][0] + runs[-1][1] == first:
            runs[-1][1] += n
        else:
            runs.append([first, n])
    return tuple((a, n) for a, n in runs)


def _take_runs(runs: tuple[tuple[int, int], ...], n: int) -> list[tuple[int, int]]:
    """The leading ``n`` tokens of ``runs``, as runs."""
    out: list[tuple[int, int]] = []
    left = n
    for first, length in runs:
        if left <= 0:
            break
        take = min(length, left)
        out.append((first, take))
        left -= take
    return out


def _content_block_ids(
    tokens: list[int], block_size: int, ids: dict[tuple[int, ...], int]
) -> tuple[int, ...]:
    """Block ids by content (``ids`` maps a block's token tuple to its id, grown as needed)."""
    if block_size == 1:
        return tuple(tokens)
    out = []
    for start in range(0, len(tokens), block_size):
        content = tuple(tokens[start : start + block_size])
        out.append(ids.setdefault(content, len(ids)))
    return tuple(out)


def _field(obj: dict[str, Any], name: str, where: str) -> Any:
    if name not in obj:
        raise TraceFormatError(f"{where}: missing field {name!r}")
    return obj[name]


def _int_field(obj: dict[str, Any], name: str, where: str, minimum: int) -> int:
    value = _field(obj, name, where)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TraceFormatError(
            f"{where}: field {name!r} must be an integer >= {minimum}, got {value!r}"
        )
    return value


INT64_MAX = 2**63 - 1


def _hash_ids(obj: dict[str, Any], where: str, block_size: int) -> list[int]:
    """The line's ids: non-negative ints whose tokens (``h*B + 1 .. h*B + B``) fit int64."""
    ids = _field(obj, "hash_ids", where)
    if not isinstance(ids, list) or not ids:
        raise TraceFormatError(f"{where}: 'hash_ids' must be a non-empty list")
    top = (INT64_MAX - block_size) // block_size
    # checked at C speed (types as a set, then min / max): a line holds thousands of ids
    if set(map(type, ids)) != {int} or min(ids) < 0:
        bad = next(h for h in ids if type(h) is not int or h < 0)
        raise TraceFormatError(f"{where}: 'hash_ids' must hold non-negative integers, got {bad!r}")
    if max(ids) > top:
        raise TraceFormatError(
            f"{where}: hash_id {max(ids)} is too large: its token ids (h*{block_size}+1 .. "
            f"h*{block_size}+{block_size}) leave int64; at most {top}"
        )
    return ids


def _timestamp(value: float, where: str, unit: str) -> float:
    if not math.isfinite(value) or value < 0:
        raise TraceFormatError(f"{where}: 'timestamp' must be a finite number >= 0 of {unit}, "
                               f"got {value!r}")
    return value


def _lines(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield ``(where, object)`` for each non-blank line; ``where`` is ``path:lineno``."""
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise TraceFormatError(f"{where}: not UTF-8 text (byte {raw[e.start]:#04x} at "
                                       f"column {e.start + 1}); a trace is JSON lines") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceFormatError(f"{where}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise TraceFormatError(f"{where}: expected a JSON object per line")
            yield where, obj


# --------------------------------------------------------------------------- formats


def detect_format(obj: dict[str, Any]) -> TraceFormat:
    """The format of one parsed trace line; raises :class:`TraceFormatError` if unknown."""
    if "hash_ids" in obj:
        return "gmi" if isinstance(obj.get("timestamp"), str) else "mooncake"
    if "input_tokens_total" in obj and "session_id" in obj:
        return "tracelab"
    raise TraceFormatError(
        "unknown trace format: expected 'hash_ids' (Mooncake / LMBench GMI) or "
        f"'session_id' + 'input_tokens_total' (TraceLab); keys were {sorted(obj)[:8]}"
    )


def _mooncake(where: str, obj: dict[str, Any], block_size: int) -> TraceRequest:
    input_length = _int_field(obj, "input_length", where, 1)
    output_length = _int_field(obj, "output_length", where, 0)
    ids = _hash_ids(obj, where, block_size)
    if len(ids) != math.ceil(input_length / block_size):
        raise TraceFormatError(
            f"{where}: {len(ids)} hash_ids for input_length {input_length}; expected "
            f"ceil({input_length}/{block_size}) = {math.ceil(input_length / block_size)}"
        )
    ts = _field(obj, "timestamp", where)
    if isinstance(ts, bool) or not isinstance(ts, int | float):
        raise TraceFormatError(f"{where}: 'timestamp' must be a number of milliseconds, got {ts!r}")
    _timestamp(ts, where, "milliseconds")
    return TraceRequest(
        timestamp_s=ts / 1000.0,
        input_length=input_length,
        output_length=output_length,
        block_size=block_size,
        block_ids=tuple(ids),
        runs=runs_from_blocks(ids, block_size, input_length),
        session=_session(obj, where),
    )


def _session(obj: dict[str, Any], where: str) -> str | None:
    """A Mooncake-format line's optional ``session`` (``workloads --out`` writes it): a string,
    or an integer kept as its decimal text (as TraceLab's ``session_id``)."""
    session = obj.get("session")
    if session is None or isinstance(session, str):
        return session
    if isinstance(session, bool) or not isinstance(session, int):
        raise TraceFormatError(f"{where}: 'session' must be a string or an integer, "
                               f"got {session!r:.80}")
    return str(session)


def _gmi(where: str, obj: dict[str, Any]) -> TraceRequest:
    output_length = _int_field(obj, "output_length", where, 0)
    ids = _hash_ids(obj, where, GMI_BLOCK_SIZE)
    ts = _field(obj, "timestamp", where)
    try:
        ts_ns = int(ts)
    except (TypeError, ValueError):
        raise TraceFormatError(
            f"{where}: 'timestamp' must be integer nanoseconds, got {ts!r}"
        ) from None
    _timestamp(ts_ns, where, "nanoseconds")
    input_length = GMI_BLOCK_SIZE * len(ids)  # one id == exactly 32 tokens (see module doc)
    return TraceRequest(
        timestamp_s=ts_ns / 1e9,  # absolute here; load_trace subtracts the earliest
        input_length=input_length,
        output_length=output_length,
        block_size=GMI_BLOCK_SIZE,
        block_ids=tuple(ids),
        runs=runs_from_blocks(ids, GMI_BLOCK_SIZE, input_length),
    )


def _first_event_time(obj: dict[str, Any], where: str) -> datetime | None:
    events = obj.get("timing_events")
    if events is None:
        return None
    if not isinstance(events, list) or not all(isinstance(ev, dict) for ev in events):
        raise TraceFormatError(f"{where}: 'timing_events' must be a list of event objects, "
                               f"got {events!r:.80}")
    for ev in events:
        stamp = ev.get("timestamp")
        if isinstance(stamp, str):
            try:
                return datetime.fromisoformat(stamp)
            except ValueError:
                raise TraceFormatError(f"{where}: bad ISO-8601 timestamp {stamp!r}") from None
    return None


class _TraceLabBuilder:
    """Chains TraceLab rounds into prompts (see the module docstring)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.next_fresh = 1  # token 0 is left unused, as in the block formats
        self.last_runs: dict[str, tuple[tuple[int, int], ...]] = {}
        self.block_content_ids: dict[tuple[int, ...], int] = {}
        self.last_t = 0.0

    def add(self, where: str, obj: dict[str, Any]) -> TraceRequest:
        session = str(_field(obj, "session_id", where))
        total = _int_field(obj, "input_tokens_total", where, 1)
        prefix = _int_field(obj, "prefix_tokens", where, 0)
        fresh = _int_field(obj, "newly_append_tokens", where, 0)
        output_length = _int_field(obj, "output_tokens", where, 0)
        if prefix + fresh != total:
            raise TraceFormatError(
                f"{where}: prefix_tokens {prefix} + newly_append_tokens {fresh} != input_tokens_total {total}"
            )
        prev = self.last_runs.get(session)
        if prev is None:  # first round of a session: its cached prefix predates the trace
            runs, fresh = [], total
        else:
            prev_len = sum(n for _, n in prev)
            runs = _take_runs(prev, min(prefix, prev_len))
            fresh = total - min(prefix, prev_len)
        runs.append((self.next_fresh, fresh))
        self.next_fresh += fresh
        runs_t = tuple(runs)
        self.last_runs[session] = runs_t
        when = _first_event_time(obj, where)
        if when is not None:  # absolute here; load_trace subtracts the earliest
            self.last_t = when.timestamp()
        tokens = TraceRequest(0.0, total, 0, 1, (), runs_t).tokens
        return TraceRequest(
            timestamp_s=self.last_t,
            input_length=total,
            output_length=output_length,
            block_size=self.block_size,
            block_ids=_content_block_ids(tokens, self.block_size, self.block_content_ids),
            runs=runs_t,
            session=session,
        )


# --------------------------------------------------------------------------- entry points


def resolve_trace_path(path: str | Path | None) -> Path:
    """``path`` if given, else the shipped Mooncake trace; raises FileNotFoundError if absent."""
    resolved = SHIPPED_TRACE if path is None else Path(path)
    if resolved.is_dir():
        raise FileNotFoundError(f"--trace {resolved} is a folder, not a trace file")
    if not resolved.is_file():
        raise FileNotFoundError(f"trace file not found: {resolved}")
    return resolved


def trace_label(path: str | Path) -> str:
    """How reports name a trace file: its path inside the repository (``bench/traces/...``)
    when it lies there, else its file name, never a machine's absolute path."""
    resolved = Path(path).resolve()
    repo = Path(__file__).resolve().parents[2]
    if resolved.is_relative_to(repo):
        return resolved.relative_to(repo).as_posix()
    return resolved.name


def sniff_format(path: str | Path | None = None) -> TraceFormat:
    """The format of a trace file, from its first non-blank line (see :func:`detect_format`).

    Raises:
        FileNotFoundError / TraceFormatError: as :func:`load_trace`, or for an empty file.
    """
    resolved = resolve_trace_path(path)
    for _, obj in _lines(resolved):
        return detect_format(obj)
    raise TraceFormatError(f"{resolved}: the trace file has no requests")


def load_trace(
    path: str | Path | None = None,
    *,
    fmt: TraceFormat | None = None,
    max_requests: int | None = None,
    mooncake_block_size: int = MOONCAKE_BLOCK_SIZE,
    tracelab_block_size: int = 1,
) -> list[TraceRequest]:
    """Read a JSONL trace into requests sorted by arrival time (stable: file order on ties).

    Timestamps are returned in seconds since the earliest request. The Mooncake and GMI files
    are already sorted; the TraceLab file lists one session after another, so its sessions
    are built in file order and then interleaved by time. The whole file is always read (the
    TraceLab chains need it); ``max_requests`` cuts the sorted list.

    Args:
        path: trace file; ``None`` means the shipped Mooncake trace (:data:`SHIPPED_TRACE`).
        fmt: ``"mooncake"``, ``"gmi"`` or ``"tracelab"``; ``None`` detects it from the first
            non-blank line (:func:`detect_format`). Every line must then have that format.
        max_requests: keep only the first ``max_requests`` requests (``None``: all).
        mooncake_block_size: tokens per hash id for Mooncake-format files (512).
        tracelab_block_size: block size recorded on TraceLab requests (1: token-exact).

    Raises:
        FileNotFoundError: the file does not exist.
        TraceFormatError: a line is not JSON, misses a field, has a bad value (a hash id
            whose token ids leave int64, a timestamp that is negative or not finite, or, in
            the Mooncake and GMI formats, earlier than the line before), or a different format
            than the first line; the message gives ``path:line``.
        ValueError: ``max_requests`` or a block size is not positive.
    """
    if max_requests is not None and max_requests < 0:
        raise ValueError(f"max_requests must be >= 0, got {max_requests}")
    if mooncake_block_size < 1 or tracelab_block_size < 1:
        raise ValueError("block sizes must be >= 1")
    resolved = resolve_trace_path(path)
    out: list[TraceRequest] = []
    prev_stamp: Any = None
    tracelab = _TraceLabBuilder(tracelab_block_size)
    for where, obj in _lines(resolved):
        line_fmt = _detect_or_none(obj)
        if fmt is None:
            fmt = detect_format(obj)  # raises a clear error for an unknown first line
        elif line_fmt is not None and line_fmt != fmt:
            raise TraceFormatError(
                f"{where}: line looks like {line_fmt!r}, not the trace's format {fmt!r}"
            )
        if fmt in ("mooncake", "gmi"):
            r = _mooncake(where, obj, mooncake_block_size) if fmt == "mooncake" else _gmi(where, obj)
            if out and r.timestamp_s < out[-1].timestamp_s:  # these files are in arrival order
                raise TraceFormatError(
                    f"{where}: timestamp {obj['timestamp']} is before the previous line's "
                    f"{prev_stamp} (the {fmt} format lists requests in arrival order)")
            prev_stamp = obj["timestamp"]
            out.append(r)
        elif fmt == "tracelab":
            out.append(tracelab.add(where, obj))
        else:
            raise ValueError(f"unknown trace format {fmt!r}; expected mooncake, gmi or tracelab")
    if not out:
        return out
    t0 = min(r.timestamp_s for r in out)
    ordered = sorted(out, key=lambda r: r.timestamp_s)  # stable: file order among equal times
    if max_requests is not None:
        ordered = ordered[:max_requests]
    return [replace(r, timestamp_s=r.timestamp_s - t0) for r in ordered]


def _detect_or_none(obj: dict[str, Any]) -> TraceFormat | None:
    """Like :func:`detect_format` but ``None`` instead of raising (the parser reports why)."""
    try:
        return detect_format(obj)
    except TraceFormatError:
        return None
