"""Every seed DPPO derives, from the training seed and a stream name. One formula per stream, each kept from the
version that first drew with it, so recorded masks and plans stay bit-identical. Each seed fits
``torch.Generator.manual_seed`` (below 2^63)."""

from __future__ import annotations

import zlib
from collections.abc import Callable

_MASK = 2**63


def _keep(base: int, index: int) -> int:
    return (base * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) % _MASK


_STREAMS: dict[str, Callable[[int, int], int]] = {
    # The keep draw of generation batch ``index`` (its training position, so a resumed run draws the same).
    "keep": _keep,
    # The micro-batch plan of generation batch ``index``: independent of its keep draw.
    "microbatch_plan": lambda base, index: _keep(base, index) ^ 0x5851F42D4C957F2D,
    # Prompt pruning's acceptance draw of generation batch ``index`` (its training position), independent of its
    # keep draw.
    "prompt_cut": lambda base, index: _keep(base, index) ^ 0x3C6EF372FE94F82B,
    # The audit's offset: which generation batches it audits.
    "audit_offset": lambda base, index: (base * 0x9E3779B97F4A7C15 + 0x2545F4914F6CDD1D) % _MASK,
}


def seed_streams() -> tuple[str, ...]:
    return tuple(_STREAMS)


def derive_seed(stream: str, base: int, index: int = 0) -> int:
    """The seed of ``stream`` for training seed ``base`` and position ``index`` (a batch count; unused by streams
    drawn once per run)."""
    if stream not in _STREAMS:
        raise ValueError(f"seed stream {stream!r} is unknown: it must be one of {list(_STREAMS)}.")
    return _STREAMS[stream](base, index)


def named_seed(seed: int, name: str, index: int = 0) -> int:
    """A seed for item ``name`` (a parameter name, a benchmark setting), chunk ``index``: the audit sketch's
    directions, the benchmarks' runs."""
    return ((seed ^ zlib.crc32(name.encode())) * 1_000_003 + index) % _MASK
