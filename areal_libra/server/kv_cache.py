"""A batched, preallocated KV cache for continuous batching on top of Hugging Face models.

Layout: per layer one key and one value buffer of shape [rows, kv_heads, capacity, head_dim]. All rows
share one write column ``length``: every decode step writes the new token of every row at that column,
so a decode step is a single batched forward with no copies of the cache (Hugging Face's DynamicCache
concatenates the whole cache every step). Rows are left-padded: a row's tokens occupy
``[length - n_tokens, length)`` and ``mask`` marks which columns are real. Positions (RoPE) are passed
per row by the caller, so padding never shifts a token's position.

Rows are recycled: a finished request leaves a dead row that the next admitted request takes over, and
the cache is compacted only when many rows are dead or the left padding dominates.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class _BufferLayer(CacheLayerMixin):
    """One layer's view onto the shared buffers; writes the step's keys at the current column."""

    is_sliding = False
    is_compileable = False

    def __init__(self, store: SlotKVCache, idx: int):
        super().__init__()
        # A proxy, not a reference: store -> layers -> store would be a cycle, and every replaced cache (a
        # reset, a weight update) would keep its buffers until a rare full collection.
        self.store = weakref.proxy(store)
        self.idx = idx
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, cache_kwargs: dict[str, Any] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.store
        b, q = key_states.shape[0], key_states.shape[2]
        start = s.length
        k_buf, v_buf = s.keys[self.idx], s.values[self.idx]
        k_buf[:b, :, start : start + q] = key_states
        v_buf[:b, :, start : start + q] = value_states
        return k_buf[:b, :, : start + q], v_buf[:b, :, : start + q]

    def get_mask_sizes(self, cache_position: torch.Tensor) -> tuple[int, int]:
        return self.store.length + cache_position.shape[0], 0

    def get_seq_length(self) -> int:
        return self.store.length

    def get_max_cache_shape(self) -> int:
        return -1


class SlotKVCache(Cache):
    """The shared buffers plus the Hugging Face ``Cache`` interface the model's attention layers call."""

    def __init__(
        self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, rows: int = 8, capacity: int = 64
    ):
        self.num_layers = num_layers
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.length = 0  # the shared write column
        self.rows = 0  # rows in use (live or dead), a prefix of the buffers
        self.keys = [self._alloc(rows, capacity) for _ in range(num_layers)]
        self.values = [self._alloc(rows, capacity) for _ in range(num_layers)]
        self.mask = torch.zeros(rows, capacity, dtype=torch.bool)
        super().__init__(layers=[_BufferLayer(self, i) for i in range(num_layers)])

    def _alloc(self, rows: int, capacity: int) -> torch.Tensor:
        return torch.zeros(rows, self.kv_heads, capacity, self.head_dim, dtype=self.dtype)

    @property
    def row_capacity(self) -> int:
        return self.mask.shape[0]

    @property
    def col_capacity(self) -> int:
        return self.mask.shape[1]

    def _regrow(self, rows: int, cols: int, shift: int = 0, keep: torch.Tensor | None = None) -> None:
        """Reallocate to (rows, cols); old columns move right by ``shift`` (negative trims the left);
        ``keep`` (row indices) reorders/drops rows."""
        n_old = self.rows if keep is None else int(keep.numel())
        lo = max(0, -shift)  # first old column kept
        width = self.length - lo
        dst = lo + shift
        new_mask = torch.zeros(rows, cols, dtype=torch.bool)
        src_mask = self.mask[: self.rows] if keep is None else self.mask.index_select(0, keep)
        new_mask[:n_old, dst : dst + width] = src_mask[:, lo : self.length]
        self.mask = new_mask
        for store in (self.keys, self.values):
            for i, buf in enumerate(store):
                nb = self._alloc(rows, cols)
                src = buf[: self.rows] if keep is None else buf.index_select(0, keep)
                nb[:n_old, :, dst : dst + width] = src[:, :, lo : self.length]
                store[i] = nb
        self.rows = n_old
        self.length = self.length + shift

    def ensure_step_room(self, steps: int = 1) -> None:
        """Make room for ``steps`` more columns (amortised doubling)."""
        need = self.length + steps
        if need > self.col_capacity:
            self._regrow(self.row_capacity, max(need, 2 * self.col_capacity))

    def add_rows(self, n: int) -> int:
        """Append ``n`` empty rows; returns the index of the first."""
        first = self.rows
        if first + n > self.row_capacity:
            self._regrow(max(first + n, 2 * self.row_capacity), self.col_capacity)
        self.rows = first + n
        self.mask[first : first + n] = False
        return first

    def widen_to(self, length: int) -> None:
        """Shift every row right so that the write column is at least ``length`` (a new prompt is longer
        than the current shared length)."""
        if length <= self.length:
            return
        shift = length - self.length
        cols = max(self.col_capacity, length + 1)
        if cols > self.col_capacity:
            cols = max(cols, 2 * self.col_capacity)
        self._regrow(self.row_capacity, cols, shift=shift)

    def place(self, row: int, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Put one sequence's prefilled keys/values ([kv_heads, n, head_dim] per layer) right-aligned at
        the write column of ``row``."""
        n = keys[0].shape[1]
        lo = self.length - n
        self.mask[row] = False
        self.mask[row, lo : self.length] = True
        for i in range(self.num_layers):
            self.keys[i][row, :, lo : self.length] = keys[i]
            self.values[i][row, :, lo : self.length] = values[i]

    def clear_row(self, row: int) -> None:
        self.mask[row] = False

    def compact(self, keep: list[int]) -> None:
        """Keep only rows ``keep`` (in that order) and trim columns that are padding in every kept row."""
        keep_t = torch.tensor(keep, dtype=torch.long)
        first = self.first_used_column(keep)
        self._regrow(self.row_capacity, self.col_capacity, shift=-first, keep=keep_t)

    def first_used_column(self, live_rows: list[int]) -> int:
        """The leftmost column any of ``live_rows`` uses: the columns before it are pure padding."""
        if not live_rows or self.length == 0:
            return self.length
        used = self.mask[live_rows, : self.length].any(dim=0)
        nz = torch.nonzero(used)
        return int(nz[0]) if nz.numel() else self.length

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.keys + self.values)


class PrefixCache:
    """Keys/values of finished sequences, reused when a later request starts with one of them.

    Multi-turn agents re-send the whole conversation every turn (prompt + previous output + tool return);
    with this cache only the new tail is prefilled. Entries are exact token sequences (no partial-entry
    matches, unlike SGLang's radix tree), evicted least-recently-used beyond ``max_tokens``, and must be
    cleared whenever the weights change.
    """

    def __init__(self, max_tokens: int):
        import collections

        self.max_tokens = max_tokens
        self.tokens = 0
        self._entries: collections.OrderedDict[tuple[int, ...], tuple[list[torch.Tensor], list[torch.Tensor]]] = (
            collections.OrderedDict()
        )
        self._lengths: collections.Counter[int] = collections.Counter()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, seq: tuple[int, ...], keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Store keys/values ([kv_heads, len(seq), head_dim] per layer; copied) for ``seq``."""
        n = len(seq)
        if n == 0 or n > self.max_tokens or seq in self._entries:
            return
        self._entries[seq] = ([k.clone() for k in keys], [v.clone() for v in values])
        self._lengths[n] += 1
        self.tokens += n
        while self.tokens > self.max_tokens:
            old, _ = self._entries.popitem(last=False)
            self._forget(len(old))

    def _forget(self, n: int) -> None:
        self.tokens -= n
        self._lengths[n] -= 1
        if not self._lengths[n]:
            del self._lengths[n]

    def match(self, ids: tuple[int, ...]) -> tuple[int, list[torch.Tensor], list[torch.Tensor]] | None:
        """The longest stored sequence that is a strict prefix of ``ids`` (at least one token is left to
        prefill, whose logits give the next token): (its length, keys, values), or None."""
        for n in sorted(self._lengths, reverse=True):
            if n < len(ids):
                hit = self._entries.get(ids[:n])
                if hit is not None:
                    self._entries.move_to_end(ids[:n])
                    return n, hit[0], hit[1]
        return None

    def clear(self) -> None:
        self._entries.clear()
        self._lengths.clear()
        self.tokens = 0
