"""Per-sequence policy state keyed by seq_id, dropped once the sequence finishes, so a long-running
engine's policies do not grow without bound."""
from __future__ import annotations

import weakref
from typing import Any


class PerSequence:
    def __init__(self):
        self._items: dict[int, tuple[weakref.ref, Any]] = {}

    def get(self, seq, default: Any = None) -> Any:
        item = self._items.get(seq.seq_id)
        return default if item is None else item[1]

    def set(self, seq, value: Any) -> None:
        self._items[seq.seq_id] = (weakref.ref(seq), value)

    def sweep(self) -> None:
        """Forget sequences that finished or no longer exist (the baselines never mark theirs finished)."""
        gone = [k for k, (ref, _) in self._items.items() if (s := ref()) is None or s.finished]
        for k in gone:
            del self._items[k]

    def __getstate__(self) -> dict:
        return {"_items": {}}  # NOTE: a copy sent to a worker starts empty: the state lives where the policy runs

    def __setstate__(self, state: dict) -> None:
        self._items = {}

    def __len__(self) -> int:
        return len(self._items)
