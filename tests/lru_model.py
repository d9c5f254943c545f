"""Plain-Python model of the LRU page pool: the executable spec of jaxkv.lru.ensure.

Written without arrays: dicts and lists, one step at a time, one layer.
"""
from __future__ import annotations


class LruModel:
    def __init__(self, num_pages: int, num_slots: int):
        self.num_pages = num_pages
        self.owner = [-1] * num_slots          # slot -> page
        self.used = [-1] * num_slots           # slot -> last step used
        self.where = {}                        # page -> slot

    def step(self, requests, protect, step):
        """Returns (slots per request, {page: slot} fetched, hits, misses, evictions, dropped)."""
        wanted = sorted({r for r in requests if 0 <= r < self.num_pages})
        hits = [p for p in wanted if p in self.where]
        misses = [p for p in wanted if p not in self.where]
        protected = {self.where[p] for p in hits}
        protected |= {self.where[p] for p in protect if p in self.where}
        free = [s for s in range(len(self.owner)) if s not in protected]
        free.sort(key=lambda s: (self.owner[s] >= 0, self.used[s] if self.owner[s] >= 0 else -1, s))
        fetched, evictions = {}, 0
        for p, s in zip(misses, free):
            old = self.owner[s]
            if old >= 0:
                del self.where[old]
                evictions += 1
            self.owner[s] = p
            self.where[p] = s
            fetched[p] = s
        dropped = max(0, len(misses) - len(free))
        for p in wanted:
            if p in self.where:
                self.used[self.where[p]] = step
        slots = [self.where.get(r, -1) if 0 <= r < self.num_pages else -1 for r in requests]
        return slots, fetched, len(hits), len(misses), evictions, dropped
