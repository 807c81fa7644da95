"""One command line for the bench tools: ``python -m bench COMMAND [ARGS...]`` (console script
``hpc-bench``), and what every command shares: argument types, output paths and optional
packages checked before a run starts, progress on stderr.

``python -m bench`` / ``python -m bench --help`` lists the commands without importing any of
them (no torch); ``python -m bench COMMAND --help`` shows one command's options. Commands are
registered by name in :data:`COMMANDS` (module, one-line summary); the core tools never import
the experimental ones.

Progress: on a terminal a tqdm bar (the ``bench`` extra; a line without it); elsewhere (a pipe,
a log, CI) one line every :data:`PROGRESS_INTERVAL_S` seconds to stderr, so a long run is never
silent. Results go to stdout.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType
from typing import Any, NamedTuple, NoReturn, TextIO

__all__ = [
    "COMMANDS",
    "TABLE_WIDTH",
    "ArgumentParser",
    "Command",
    "command_parser",
    "Progress",
    "check_output_path",
    "column_blocks",
    "figure_path",
    "main",
    "new_parser",
    "non_negative_float",
    "output_path",
    "parse_count",
    "positive",
    "positive_float",
    "probability",
    "prog",
    "refuse_ignored",
    "refuse_unified_policies",
    "require_package",
    "seed",
    "state_fraction",
    "text_stream",
    "warn_page_split",
    "write_json",
]


class Command(NamedTuple):
    """One command of :data:`COMMANDS`."""

    module: str
    """The module whose ``main(argv)`` runs it (and returns the exit code)."""
    summary: str
    """What it does, one line (``python -m bench``)."""
    parser: str
    """``module:function`` building its ``argparse`` parser without importing torch:
    ``COMMAND --help`` builds only that (a test checks every command)."""


def _command(module: str, summary: str, parser: str = "build_parser") -> Command:
    return Command(module, summary, parser if ":" in parser else f"{module}:{parser}")


#: Command -> how it runs, what it does, where its parser is: the user's tools, then the
#: developer instruments of :mod:`bench.dev` when the checkout has them (:func:`_dev_commands`).
COMMANDS: dict[str, Command] = {
    "replay": _command("bench.runs.replay", "trace replay in the engine model: hit rates, "
                       "state misses, memory, per policy and pool size (the main job)"),
    "simulate": _command("bench.runs.simulate", "timed engine simulator: TTFT, throughput, "
                         "hit rates; sweeps over one axis (--sweep), CSV and plots"),
    "robustness": _command("bench.runs.robustness", "every policy on every trace and generated "
                           "workload across memory sizes: the robustness table"),
    "memory-split": _command("bench.runs.memory_split", "fixed KV / state splits of a byte "
                             "budget against one memory arena evicting by value (unified)"),
    "workloads": _command("bench.workloads.__main__", "generate a seeded workload (docqa, "
                          "agentic, multiturn, sysprompt, toolcall, mix), print its reuse"),
    "trace-stats": _command("bench.traces.stats", "reuse statistics of a trace file"),
    "convert": _command("bench.traces.convert", "convert a TraceLab trace to the Mooncake format"),
}

def _dev_commands() -> dict[str, Command]:
    """The developer instruments' commands (:data:`bench.dev.COMMANDS`: module, summary,
    parser), or none when :mod:`bench.dev` is absent: it lives in the repository only, never in
    the wheel."""
    if importlib.util.find_spec("bench.dev") is None:
        return {}
    dev = importlib.import_module("bench.dev")
    return {name: _command(*spec) for name, spec in dev.COMMANDS.items()}


COMMANDS.update(_dev_commands())

#: Seconds between two progress lines when stderr is not a terminal.
PROGRESS_INTERVAL_S = 5.0


def prog(command: str) -> str:
    """The ``prog`` of a command's parser: how the user typed it."""
    return f"python -m bench {command}"


# ------------------------------------------------------------------ argument types
class ArgumentParser(argparse.ArgumentParser):
    """Every command's parser: argparse's, with an argument error in one line on stderr
    (``python -m bench replay: error: MESSAGE (python -m bench replay --help: the options)``,
    exit status 2) instead of the whole usage before it."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help: the options)\n")


def new_parser(command: str, description: str) -> ArgumentParser:
    """Command ``command``'s parser: an :class:`ArgumentParser` with its :func:`prog` and its
    ``--help`` text ``description`` (every command's ``build_parser`` starts with it)."""
    return ArgumentParser(prog=prog(command), description=description)


_SUFFIX = {"K": 10**3, "M": 10**6, "G": 10**9}


def parse_count(text: str) -> int:
    """``"16000000"``, ``"16e6"``, ``"16M"``, ``"512K"`` -> int (a whole number >= 0)."""
    s = text.strip().upper().replace("_", "").replace(",", "")
    scale = 1
    if s and s[-1] in _SUFFIX:
        scale, s = _SUFFIX[s[-1]], s[:-1]
    if s.isascii() and s.isdigit():  # digits alone: exact, whatever the size (a float keeps 53 bits)
        return int(s) * scale
    try:
        value = float(s) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a count: {text!r} (try 16000000, 16e6 or 16M)"
        ) from None
    if not math.isfinite(value) or value < 0 or value != int(value):
        raise argparse.ArgumentTypeError(f"not a whole non-negative count: {text!r}")
    return int(value)


def positive(text: str) -> int:
    """:func:`parse_count` of at least 1."""
    value = parse_count(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1: {text!r}")
    return value


def _number(text: str, ok: Callable[[float], bool], what: str) -> float:
    """``float(text)`` when ``ok`` of it, else an argument error saying it must be ``what``."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"must be {what}: {text!r}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0."""
    return _number(text, lambda v: 0 < v < math.inf, "a finite number > 0")


def seed(text: str) -> int:
    """A random seed: a whole number >= 0, written in digits."""
    s = text.strip().replace("_", "")
    if not (s.isascii() and s.isdigit()):
        raise argparse.ArgumentTypeError(f"not a seed (a whole number >= 0): {text!r}")
    return int(s)


def probability(text: str) -> float:
    """A number in ``[0, 1]``."""
    return _number(text, lambda v: 0 <= v <= 1, "in [0, 1]")


def non_negative_float(text: str) -> float:
    """A finite number >= 0."""
    return _number(text, lambda v: 0 <= v < math.inf, "a finite number >= 0")


def state_fraction(text: str) -> float | str:
    """``--state-fraction``: the states' share of ``--memory-gb`` (a number in ``[0, 1)``),
    or ``unified``: one arena for both kinds, its boundary moving at run time
    (:mod:`bench.engine.arena`)."""
    from bench.engine.presets import UNIFIED

    if text == UNIFIED:
        return UNIFIED
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number in [0, 1) or {UNIFIED!r}, got {text!r}") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1) (or {UNIFIED!r}): {text!r}")
    return value


def refuse_unified_policies(splits: Sequence[float | str], policies: Sequence[str] | None,
                            option: str = "--policy") -> None:
    """``ValueError`` naming ``--policy`` when policies other than ``unified`` are given and
    every split is ``unified`` (the arena has one policy, no knob), or when ``unified`` is
    given and a run has fixed pools: ``splits`` holds a fraction, or is empty (pools sized by
    ``--kv-tokens`` / ``--state-slots``). That policy weighs bytes, which only the arena's
    pools give. ``option``: how the command spells ``--policy``."""
    from bench.engine.presets import UNIFIED

    other = [p for p in policies or () if p != UNIFIED]
    if other and splits and all(f == UNIFIED for f in splits):
        raise ValueError(f"{option} {' '.join(other)}: --state-fraction {UNIFIED} runs one "
                         f"policy, {UNIFIED} (drop --policy)")
    if UNIFIED in (policies or ()) and not (splits and all(f == UNIFIED for f in splits)):
        raise ValueError(f"{option} {UNIFIED}: only --state-fraction {UNIFIED} (with --model "
                         f"and --memory-gb) runs it, on one arena whose bytes it weighs; fixed "
                         f"pools have no byte sizes (drop {UNIFIED} from {option})")


def check_output_path(path: str) -> str | None:
    """Why ``path`` cannot be written (its folder missing or read-only, a folder itself), or
    ``None``; ``"-"`` (stdout) is always fine."""
    if path == "-":
        return None
    if os.path.isdir(path):
        return f"{path!r} is a folder"
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return f"the folder of {path!r} does not exist"
    if not os.access(folder, os.W_OK):
        return f"the folder of {path!r} is not writable"
    return None


def output_path(text: str) -> str:
    """Argument type of an output file (``-``: stdout), checked when the command line is read,
    so a bad path fails before the run, not after it."""
    why = check_output_path(text)
    if why is not None:
        raise argparse.ArgumentTypeError(why)
    return text


#: What matplotlib's ``savefig`` writes, by file suffix (its Agg, PDF, PS, SVG and PGF
#: backends), spelled out so that checking a ``--plot`` path imports no matplotlib.
FIGURE_FORMATS = frozenset({"png", "pdf", "svg", "svgz", "eps", "ps", "jpg", "jpeg", "tif",
                            "tiff", "webp", "pgf", "raw", "rgba"})


def figure_path(text: str) -> str:
    """Argument type of a figure file: an :func:`output_path` whose suffix names a format
    matplotlib writes (:data:`FIGURE_FORMATS`), so ``--plot out.txt`` fails before the run."""
    path = output_path(text)
    suffix = os.path.splitext(path)[1].lower().lstrip(".")
    if path == "-" or suffix not in FIGURE_FORMATS:
        raise argparse.ArgumentTypeError(
            f"{text!r}: the file name must end in a figure format "
            f"({', '.join(sorted(FIGURE_FORMATS))})")
    return path


#: Columns a table may take unless ``--wide``: runs beyond it go to a further block of rows.
TABLE_WIDTH = 120


def column_blocks(label_width: int, widths: Sequence[int], limit: int | None) -> list[list[int]]:
    """The run columns in blocks, each (with the row labels) at most ``limit`` characters wide
    (a column wider than that alone in its block); ``None``: one block."""
    blocks: list[list[int]] = [[]]
    used = label_width
    for i, w in enumerate(widths):
        if limit is not None and blocks[-1] and used + 2 + w > limit:
            blocks.append([])
            used = label_width
        blocks[-1].append(i)
        used += 2 + w
    return blocks


def warn_page_split(prog_name: str, page_size: int, block_size: int) -> None:
    """On stderr, when ``page_size`` does not divide the trace's ``block_size``: shared blocks
    then end inside a page, and a page a block shares only in part is not cached."""
    if block_size % page_size:
        print(f"{prog_name}: warning: --page-size {page_size} does not divide the trace's block "
              f"size ({block_size} tokens): shared blocks end inside a page, and pages a block "
              "shares only in part are not cached", file=sys.stderr)


def text_stream(json_path: str | None) -> TextIO:
    """Where a command prints its tables and progress: stdout, or stderr when ``--json -``
    gives stdout to the JSON (so that stdout is one JSON document)."""
    return sys.stderr if json_path == "-" else sys.stdout


def write_json(path: str, obj: Any) -> None:
    """Write ``obj`` as indented JSON to ``path`` (``"-"``: stdout), ending with a newline."""
    text = json.dumps(obj, indent=2)
    if path == "-":
        print(text)
    else:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text + "\n")


def require_package(parser: argparse.ArgumentParser, module: str, option: str,
                    extra: str) -> None:
    """Stop with a usage error before the run when ``option`` needs ``module`` and it is not
    installed (``extra``: the project's extra that brings it)."""
    if importlib.util.find_spec(module) is None:
        parser.error(f"{option} needs {module}: pip install 'hybrid-prefix-cache[{extra}]'")


def refuse_ignored(parser: argparse.ArgumentParser,
                   rules: Iterable[tuple[str, object, str, bool]]) -> None:
    """Stop with a one-line usage error (exit status 2) when an option was given whose
    condition is off, so it would be silently ignored. Each rule is ``(option, its value
    (None: not given), what it needs, whether that is given)``."""
    for option, value, needs, on in rules:
        if value is not None and not on:
            parser.error(f"{option} needs {needs}, which is off (give {needs}, or drop {option})")


# ------------------------------------------------------------------ progress
class Progress:
    """Progress of ``total`` steps on stderr: a tqdm bar on a terminal (a line when tqdm is
    absent), elsewhere one line every :data:`PROGRESS_INTERVAL_S` seconds and a last one.

    Args:
        total: steps expected.
        desc: what runs (starts every line).
        unit: what a step is (``"req"``, ``"run"``).
        enabled: ``True`` always, ``False`` never, ``None`` (default) always too: a terminal
            gets the bar, anything else the lines.
    """

    def __init__(self, total: int, desc: str, unit: str = "req",
                 enabled: bool | None = None) -> None:
        self.total, self.desc, self.unit = total, desc, unit
        self.enabled = enabled is not False
        self.n = 0
        self._bar: Any = None
        self._start = self._last = time.monotonic()
        if self.enabled and sys.stderr.isatty() and importlib.util.find_spec("tqdm"):
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr,
                             mininterval=0.5, leave=False)

    def update(self, n: int = 1) -> None:
        self.n += n
        if self._bar is not None:
            self._bar.update(n)
            return
        if self.enabled:
            now = time.monotonic()
            if now - self._last >= PROGRESS_INTERVAL_S:
                self._last = now
                self._line(now)

    def _line(self, now: float) -> None:
        elapsed = now - self._start
        rate = self.n / elapsed if elapsed > 0 else 0.0
        speed = f"{rate:,.0f} {self.unit}/s" if rate >= 1 else f"{elapsed / max(self.n, 1):,.1f} s/{self.unit}"
        print(f"{self.desc}: {self.n:,}/{self.total:,} {self.unit} ({speed}, {elapsed:.0f} s)",
              file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self.enabled and self.n and time.monotonic() - self._start >= PROGRESS_INTERVAL_S:
            self._line(time.monotonic())
        self.enabled = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


# ------------------------------------------------------------------ the command line
def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: python -m bench COMMAND [ARGS...]   (or: hpc-bench COMMAND [ARGS...])",
             "", "commands:"]
    lines += [f"  {name:<{width}}  {cmd.summary}" for name, cmd in COMMANDS.items()]
    lines += ["", "python -m bench COMMAND --help shows the options of one command."]
    return "\n".join(lines)


def command_parser(name: str) -> argparse.ArgumentParser:
    """Command ``name``'s parser, importing only the module that builds it (no torch)."""
    module, _, function = COMMANDS[name].parser.partition(":")
    parser: argparse.ArgumentParser = getattr(importlib.import_module(module), function)()
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``argv[0]``'s command with the rest of ``argv``; its exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"python -m bench: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    cmd = COMMANDS[name]
    if "-h" in rest or "--help" in rest:  # the parser alone: no torch, no run
        command_parser(name).parse_args(rest)
    module = importlib.import_module(cmd.module)
    code = module.main(rest)
    return int(code or 0)


def console_main() -> int:
    """The console script (``hpc-bench``) and ``python -m bench``: :func:`main`, quiet when
    the reader of stdout goes away (``hpc-bench --help | head -3``)."""
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:
        # stdout's reader closed it: point stdout at /dev/null so the interpreter's final
        # flush does not raise again, and exit as a pipe writer killed by SIGPIPE would
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    return code
