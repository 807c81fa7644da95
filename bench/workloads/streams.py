"""Token streams: the building block of the generated workloads.

A *stream* is one growing context (a chat, an agent's transcript, a document and the questions
asked on it) written as trace blocks, the same encoding the trace loaders use: block ``h`` of
``n`` tokens is the token ids ``h*B + 1 .. h*B + n`` (``B`` = block size). A request's prompt is
a snapshot of a stream; two prompts share exactly the tokens of the blocks they share, so the
prefix sharing a generator writes is the sharing the replay's radix tree sees::

    stream   [ b0 ][ b1 ][ b2 ][ b3 ][ b4 |...    ]      B tokens per block, the last partial
              0     B     2B    3B    4B   len
    fork     [ b0 ][ b1 ][ b2 ][ b3 ][ c0 ][ c1 |..]     shares whole blocks only: floor(len/B)
    append   fills the partial last block first (the stream owns it), then fresh blocks

A fork shares whole blocks only, so two streams never write different tokens into one block
id: the only partial block of a stream is its last one and no other stream holds it. Fresh
block ids come from one counter per :class:`BlockSpace`, so workloads mixed from several
generators never collide (give them one space).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bench.traces.loader import TraceRequest, runs_from_blocks

__all__ = ["BlockSpace", "Stream"]


@dataclass
class BlockSpace:
    """Hands out fresh block ids (``next_id`` upwards) for streams of ``block_size`` tokens.

    Raises:
        ValueError: ``block_size < 1`` or ``next_id < 0``.
    """

    block_size: int = 64
    next_id: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) \
                or self.block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {self.block_size!r}")
        if self.next_id < 0:
            raise ValueError(f"next_id must be >= 0, got {self.next_id}")

    def fresh(self, n: int) -> list[int]:
        """``n`` new block ids."""
        out = list(range(self.next_id, self.next_id + n))
        self.next_id += n
        return out

    def stream(self, tokens: int = 0) -> Stream:
        """A new stream of ``tokens`` fresh tokens."""
        s = Stream(self)
        s.append(tokens)
        return s


@dataclass
class Stream:
    """One context: ``blocks`` (ids, the last one possibly partial) and ``length`` [tokens]."""

    space: BlockSpace
    blocks: list[int] = field(default_factory=list)
    length: int = 0

    def append(self, tokens: int) -> None:
        """Append ``tokens`` fresh tokens (``ValueError`` if negative)."""
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        b = self.space.block_size
        new_len = self.length + tokens
        need = -(-new_len // b) - len(self.blocks)
        if need > 0:
            self.blocks.extend(self.space.fresh(need))
        self.length = new_len

    def fork(self) -> Stream:
        """A new stream sharing this one's whole blocks (``floor(length / B)`` of them)."""
        whole = self.length // self.space.block_size
        return Stream(self.space, self.blocks[:whole], whole * self.space.block_size)

    def request(self, timestamp_s: float, output_length: int,
                session: str | None = None) -> TraceRequest:
        """The stream as one request's prompt (``ValueError`` on an empty stream)."""
        if self.length < 1:
            raise ValueError("a request needs a prompt of at least one token")
        ids = tuple(self.blocks)
        return TraceRequest(
            timestamp_s=float(timestamp_s),
            input_length=self.length,
            output_length=int(output_length),
            block_size=self.space.block_size,
            block_ids=ids,
            runs=runs_from_blocks(list(ids), self.space.block_size, self.length),
            session=session,
        )
