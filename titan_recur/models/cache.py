"""A preallocated KV cache for decoding at any test-time depth, with K/V sharing across core iterations.

Each attention slot (docs/generation.md) is one buffer per K and V, sized for the whole generation
(prompt + new tokens) and written in place at the step's columns: no per-token ``torch.cat``.
Prelude and coda blocks have one slot each; a core block has one slot per *slot index*, which the
``kv_sharing`` mode maps iterations to (iteration i is 0-based):

- ``"full"``: r slots, iteration i writes and reads slot i. Exact: a later token's iteration i sees
  the iteration-i K/V of every past position, as an uncached forward computes them.
- ``"latest"``: 1 slot, every iteration overwrites the current position's K/V, so a later token sees,
  at each past position, the K/V of the last iteration run there. The cache is that of a static model
  of P + R + C layers, whatever r is.
- ``"compress-N"``: N slots, iteration i writes and reads slot i mod N (``"compress-1"`` is
  ``"latest"``; N >= r is ``"full"``).

A token that ran fewer iterations m than there are slots (adaptive exit, docs/generation.md) leaves
slots m .. N-1 unwritten at its position; ``fill_skipped`` copies its last computed K/V (slot m-1)
into them, so every slot of a past position holds "the K/V of the last iteration run there whose
slot it is, or else the last computed one". ``writes_only(rows)`` masks writes per row: a row that
has exited keeps its K/V while the rest of its batch iterates on, so a batched run equals each row alone.

A forward through the cache writes the columns ``length .. length + T - 1`` (``begin``) and then
``advance``s by T; ``crop(n)`` rolls the cache back to its first n columns (speculative decoding
drops rejected drafts so; HF's assisted decoding calls ``crop`` by that name): later writes
overwrite the dropped columns, and attention never reads past the written prefix.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from titan_recur.models.args import ModelArgs

# Where a block sits: ("prelude" | "core" | "coda", index in its stack). The cache keys its slots by it
# (and, for core blocks, by the iteration), so blocks never see cache layout.
BlockSlot = tuple[str, int]
_COMPRESS = re.compile(r"compress-([1-9][0-9]*)")


def core_slots_per_block(kv_sharing: str, num_steps: int) -> int:
    """K/V slots a core block keeps at ``num_steps`` iterations: r, 1, or min(N, r)."""
    if kv_sharing == "full":
        return num_steps
    if kv_sharing == "latest":
        return 1
    match = _COMPRESS.fullmatch(kv_sharing)
    if match is None:
        raise ValueError(f"kv_sharing must be 'full', 'latest' or 'compress-N' with N >= 1, got {kv_sharing!r}")
    return min(int(match.group(1)), num_steps)


class KVCache:
    """Preallocated keys/values of every attention slot (see the module docstring for the layout).

    ``length`` is the number of columns written (the next step writes from there); columns follow
    the padded batch, so every row writes the same columns and left padding is masked by the
    attention mask. Attention reads the written prefix only (a view: no copy), so its cost grows
    with the tokens cached, not with the capacity.
    """

    def __init__(
        self,
        *,
        batch_size: int,
        capacity: int,
        n_prelude: int,
        n_core: int,
        n_coda: int,
        n_kv_heads: int,
        head_dim: int,
        num_steps: int,
        kv_sharing: str = "full",
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.kv_sharing = kv_sharing
        self.num_steps = num_steps
        self.slots_per_block = core_slots_per_block(kv_sharing, num_steps) if n_core else 0
        self.length = 0
        self.key_length = 0
        self.write_index = torch.zeros(0, dtype=torch.long, device=device)
        # Rows whose K/V a write may change; None = all rows.
        self.write_rows: torch.Tensor | None = None
        shape = (batch_size, n_kv_heads, capacity, head_dim)
        # (part, index) -> (K, V); a core block's tensors carry the slot index in front: (N, B, H, L, D).
        self.buffers: dict[BlockSlot, tuple[torch.Tensor, torch.Tensor]] = {}
        self._views: dict[int, IterationView] = {}
        for part, count, lead in (
            ("prelude", n_prelude, ()),
            ("core", n_core, (self.slots_per_block,)),
            ("coda", n_coda, ()),
        ):
            for index in range(count):
                self.buffers[(part, index)] = tuple(  # type: ignore[assignment]
                    torch.zeros(*lead, *shape, dtype=dtype, device=device) for _ in range(2)
                )

    @classmethod
    def for_args(
        cls,
        args: ModelArgs,
        batch_size: int,
        capacity: int,
        num_steps: int,
        kv_sharing: str = "full",
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> KVCache:
        """A cache for a model of ``args`` (``RecurrentLM.new_cache``: in its parameters' dtype and device)."""
        return cls(
            batch_size=batch_size,
            capacity=capacity,
            n_prelude=args.n_prelude,
            n_core=args.n_core,
            n_coda=args.n_coda,
            n_kv_heads=args.n_kv_heads,
            head_dim=args.head_dim,
            num_steps=num_steps,
            kv_sharing=kv_sharing,
            dtype=dtype,
            device=device,
        )

    @staticmethod
    def planned_bytes(
        args: ModelArgs, batch_size: int, capacity: int, num_steps: int, kv_sharing: str, element_size: int
    ) -> int:
        """Bytes a cache for ``args`` would allocate: (P + C + R x slots per block) x 2 x B x H_kv x L x D x size."""
        slots = args.n_prelude + args.n_coda + args.n_core * core_slots_per_block(kv_sharing, num_steps)
        return slots * 2 * batch_size * args.n_kv_heads * capacity * args.head_dim * element_size

    @property
    def capacity(self) -> int:
        return next(iter(self.buffers.values()))[0].shape[-2]

    @property
    def num_layer_slots(self) -> int:
        """Attention slots held: P + C + R x (slots per core block)."""
        return sum(k.shape[0] if k.ndim == 5 else 1 for k, _ in self.buffers.values())

    def nbytes(self) -> int:
        """Bytes of the allocated K/V buffers."""
        return sum(t.untyped_storage().nbytes() for pair in self.buffers.values() for t in pair)

    def begin(self, seqlen: int) -> int:
        """Prepare a step of ``seqlen`` new columns; returns the key length attention sees (the mask's width)."""
        end = self.length + seqlen
        if end > self.capacity:
            self._grow(end)
        self.write_index = torch.arange(self.length, end, device=self.write_index.device)
        self.key_length = end
        return self.key_length

    def reset(self) -> None:
        """Empty the cache for a new generation in the same buffers: every write full-width again."""
        self.length = self.key_length = 0
        self.write_rows = None

    def pin(self, column: torch.Tensor, write_rows: torch.Tensor | None = None, key_length: int | None = None) -> None:
        """Static decoding (inference/decode_program.py): every write goes to the device tensor ``column``
        (1,), masked by ``write_rows`` (B,) where given, and attention reads the whole capacity (a compiled
        step: its shapes never change), or its first ``key_length`` columns (an uncompiled step: no more
        than has been written); the caller's key mask hides the columns not yet written."""
        self.write_index = column
        self.write_rows = write_rows
        self.key_length = self.capacity if key_length is None else key_length

    def advance(self, seqlen: int) -> None:
        """Mark the step's ``seqlen`` columns written: the next step writes after them."""
        self.length += seqlen

    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` columns (negative: drop the last -max_length), as HF caches' ``crop``."""
        if max_length < 0:
            max_length = self.length + max_length
        self.length = max(0, min(self.length, max_length))

    @contextmanager
    def writes_only(self, rows: torch.Tensor | None) -> Iterator[None]:
        """Within the block, writes change the rows where ``rows`` (B,) is True only (None: every row)."""
        previous, self.write_rows = self.write_rows, rows
        try:
            yield
        finally:
            self.write_rows = previous

    def update(self, slot: BlockSlot, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write a prelude or coda block's k, v (B, H, T, D) into its slot; return the slot's keys/values.

        A core block writes through its iteration's view (``iteration_view``).
        """
        keys, values = self.buffers[slot]
        if keys.ndim == 5:
            raise ValueError(f"core slot {slot} is written through iteration_view(i), which picks the iteration's slot")
        return self.write(keys, values, k, v)

    def write(
        self, keys: torch.Tensor, values: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v at the step's columns (rows in ``write_rows`` only); return what attention reads."""
        for buffer, new in ((keys, k), (values, v)):
            if self.write_rows is not None:
                kept = buffer.index_select(2, self.write_index)
                new = torch.where(self.write_rows[:, None, None, None], new, kept)
            buffer.index_copy_(2, self.write_index, new)
        return keys[:, :, : self.key_length], values[:, :, : self.key_length]

    def iteration_view(self, iteration: int) -> IterationView:
        """The cache as core iteration ``iteration`` (0-based) sees it (see ``IterationView``)."""
        if iteration >= self.num_steps and self.kv_sharing == "full":
            raise ValueError(f"iteration {iteration} beyond the {self.num_steps} this 'full' cache was built for")
        index = iteration % self.slots_per_block
        if index not in self._views:
            self._views[index] = IterationView(self, index)
        return self._views[index]

    @torch.no_grad()
    def fill_skipped(self, steps: torch.Tensor) -> None:
        """After a step in which row b ran ``steps[b]`` iterations at the step's columns: slots it did not
        reach there (index >= steps[b]) get its last computed K/V (slot steps[b] - 1)."""
        n = self.slots_per_block
        if n <= 1:
            return
        slot = torch.arange(n, device=steps.device)[:, None]
        source = torch.minimum(slot, (steps[None, :] - 1).clamp(min=0))  # (N, B)
        for (part, _), pair in self.buffers.items():
            if part != "core":
                continue
            for buffer in pair:
                columns = buffer.index_select(3, self.write_index)  # (N, B, H, T, D)
                index = source[:, :, None, None, None].expand_as(columns)
                buffer.index_copy_(3, self.write_index, columns.gather(0, index))

    def reorder(self, beam_idx: torch.Tensor) -> None:
        """Reorder the batch (beam search): row b becomes row ``beam_idx[b]``."""
        for slot, (keys, values) in self.buffers.items():
            dim = keys.ndim - 4
            self.buffers[slot] = (keys.index_select(dim, beam_idx), values.index_select(dim, beam_idx))
        self._views.clear()

    def _grow(self, needed: int) -> None:
        """Reallocate every buffer for at least ``needed`` columns (callers that cannot size the cache up front)."""
        capacity = max(needed, 2 * self.capacity)
        for slot, pair in self.buffers.items():
            self.buffers[slot] = tuple(F.pad(t, (0, 0, 0, capacity - t.shape[-2])) for t in pair)  # type: ignore[assignment]
        self._views.clear()


class IterationView:
    """A core iteration's view of a ``KVCache``: each core block's slot for that iteration chosen up front.

    It lets a compiled core iteration serve every iteration with one graph: the iteration index never
    enters the compiled code, only same-shaped buffer views do.
    """

    def __init__(self, cache: KVCache, index: int) -> None:
        self.cache = cache
        self.slots = {slot: (k[index], v[index]) for slot, (k, v) in cache.buffers.items() if k.ndim == 5}

    def update(self, slot: BlockSlot, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write a core block's k, v into this iteration's slot; return what attention reads."""
        return self.cache.write(*self.slots[slot], k, v)
