"""Load time and bytes of real PEFT adapters: ``python -m bench lora-load``.

Adapters are made by PEFT (``get_peft_model`` + ``save_pretrained``, safetensors) on a
Llama-shaped model built from a config (random weights, nothing downloaded), for every rank of
``--ranks`` and every target-module set (``q_proj,v_proj``; the four attention projections;
``all-linear``). For each adapter the table gives:

* bytes: the two files on disk, and the weights in host memory (``LoraAdapter.nbytes``,
  checked equal to ``sum over modules of r * (in + out) * itemsize``);
* CPU time (``time.process_time``, median of ``--repeats``; files in the page cache after the
  first read) of, side by side in one run:

  - ``safetensors``: ``safetensors.torch.load_file`` alone (the floor: bytes off the file);
  - ``peft``: PEFT's own ``load_peft_weights`` (its state-dict read);
  - ``read``: :func:`~allocators.lora.read_peft_adapter` (the read plus every check of the
    config against the tensors);
  - ``load``: ``LoraManager.load_adapter`` (read, base-model checks, host copy into the pool
    dtype) and ``unload_adapter``;
  - ``fill``: one device-slot fill by ``prepare_batch`` (zero the slot, copy A and B in).

Needs ``peft`` and ``transformers`` (``pip install -e ".[lora,model]"``).

Example::

    python -m bench lora-load --hidden 1024 --layers 4 --ranks 8 16 64 --repeats 5
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

from allocators.lora import (
    ADAPTER_CONFIG_NAME,
    ADAPTER_WEIGHTS_NAME,
    BASE_MODEL,
    LoraArgs,
    LoraManager,
    linear_module_shapes,
    read_peft_adapter,
)
from bench.dev.lora.options import lora_load_parser

__all__ = ["main", "measure"]

TARGET_SETS: dict[str, list[str] | str] = {
    "q,v": ["q_proj", "v_proj"],
    "attention": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "all-linear": "all-linear",
}


def _model(hidden: int, layers: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 128),
        head_dim=64,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def _make(directory: Path, hidden: int, layers: int, rank: int, targets: list[str] | str) -> Path:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        _model(hidden, layers),
        LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False),
    )
    model.save_pretrained(str(directory))
    return directory


def _cpu_seconds(
    fn: Callable[[], object], repeats: int, before: Callable[[], object] | None = None
) -> float:
    """Median CPU seconds of ``fn()``; ``before()`` runs untimed ahead of each call."""
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return statistics.median(times)


def measure(
    hidden: int, layers: int, ranks: Sequence[int], repeats: int, workdir: Path
) -> list[dict[str, Any]]:
    """One row per (rank, target set); see the module docstring for the columns."""
    from peft.utils import load_peft_weights
    from safetensors.torch import load_file

    shapes = linear_module_shapes(_model(hidden, layers))
    rows = []
    for rank in ranks:
        for label, targets in TARGET_SETS.items():
            d = _make(workdir / f"r{rank}-{label}", hidden, layers, rank, targets)
            adapter = read_peft_adapter(d)
            expected = sum(
                adapter.rank_of(m) * (shapes[m][0] + shapes[m][1]) * adapter.dtype.itemsize
                for m in adapter.modules
            )
            assert adapter.nbytes == expected, (adapter.nbytes, expected)
            m = LoraManager(
                LoraArgs(lora_paths=[f"a={d}"], max_loras_per_batch=1),
                shapes,
            )
            uid = m.uid_of("a")

            def load(m: LoraManager = m, d: Path = d) -> None:
                m.load_adapter("b", d)
                m.unload_adapter("b")

            def evict(m: LoraManager = m) -> None:
                m.pool.prepare_batch([BASE_MODEL])  # one slot: the adapter leaves it

            weights_file = str(d / ADAPTER_WEIGHTS_NAME)
            rows.append(
                {
                    "rank": rank,
                    "targets": label,
                    "modules": len(adapter.modules),
                    "file_bytes": sum(
                        (d / n).stat().st_size for n in (ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME)
                    ),
                    "host_bytes": adapter.nbytes,
                    "safetensors_s": _cpu_seconds(partial(load_file, weights_file), repeats),
                    "peft_s": _cpu_seconds(partial(load_peft_weights, str(d)), repeats),
                    "read_s": _cpu_seconds(partial(read_peft_adapter, d), repeats),
                    "load_s": _cpu_seconds(load, repeats),
                    "fill_s": _cpu_seconds(
                        partial(m.pool.prepare_batch, [uid]), repeats, before=evict
                    ),
                }
            )
    return rows


def render(rows: Sequence[dict[str, Any]], hidden: int, layers: int) -> str:
    head = (
        f"Llama-shaped model: hidden {hidden}, {layers} layers, float32 adapters made by PEFT\n"
        f"{'rank':>4} {'targets':>10} {'modules':>7} {'file MB':>8} {'host MB':>8} "
        f"{'safetensors ms':>14} {'peft ms':>8} {'read ms':>8} {'load ms':>8} {'fill ms':>8}"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"{r['rank']:>4} {r['targets']:>10} {r['modules']:>7} {r['file_bytes'] / 1e6:>8.2f} "
            f"{r['host_bytes'] / 1e6:>8.2f} {r['safetensors_s'] * 1e3:>14.2f} "
            f"{r['peft_s'] * 1e3:>8.2f} {r['read_s'] * 1e3:>8.2f} {r['load_s'] * 1e3:>8.2f} "
            f"{r['fill_s'] * 1e3:>8.2f}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = lora_load_parser()
    args = p.parse_args(argv)
    if args.hidden < 64 or args.hidden % 64:
        p.error("--hidden must be a positive multiple of 64")
    missing = [name for name in ("peft", "transformers") if importlib.util.find_spec(name) is None]
    if missing:
        p.exit(2, f"{p.prog}: error: {missing} not installed (pip install -e '.[lora,model]')\n")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="hpc-lora-load-") as tmp:
        rows = measure(args.hidden, args.layers, args.ranks, args.repeats, Path(tmp))
    print(render(rows, args.hidden, args.layers))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
