"""Automatic prefix caching, on the host: which pool pages hold the K/V of which token prefixes.

A full page of a prompt is keyed by a hash chain: the key of page k is the SHA-256 of the key of
page k - 1 and the page's `page_size` token ids, so that a key names the whole prefix up to the
end of its page (and positions with it). The engine retains the pages the cache has in the pool
(`jaxpaged.retain`: one holder more), so that they outlive the sequence that computed them, and
a later request whose prompt starts with the same tokens attaches them (`jaxpaged.attach`)
instead of computing them again. The cache counts the running sequences that use each of its
pages; the pages none uses are idle, and evicted least recently used first (`jaxpaged.drop`)
when the scheduler needs pages. No JAX here.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Sequence as Seq

import numpy as np


def page_keys(tokens: Seq[int], page_size: int) -> list[bytes]:
    """The keys of the full pages of `tokens`: key k hashes key k - 1 and tokens
    `k * page_size : (k + 1) * page_size`."""
    keys, key = [], b""
    for start in range(0, len(tokens) - page_size + 1, page_size):
        page = np.asarray(tokens[start : start + page_size], np.int64).tobytes()
        key = hashlib.sha256(key + page).digest()
        keys.append(key)
    return keys


class PrefixCache:
    """Page ids by key, with the number of running sequences that use each page and the idle
    pages (used by none) in least recently used order."""

    def __init__(self):
        self._page: dict[bytes, int] = {}
        self._key: dict[int, bytes] = {}
        self._users: dict[int, int] = {}
        self._idle: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._num_shared = 0  # pages used by two or more running sequences

    @property
    def num_pages(self) -> int:
        """The pages the cache holds."""
        return len(self._page)

    def __contains__(self, page: int) -> bool:
        return page in self._key

    @property
    def num_idle(self) -> int:
        """The cached pages no running sequence uses: what `evict` can free."""
        return len(self._idle)

    @property
    def num_shared(self) -> int:
        """The cached pages that two or more running sequences use."""
        return self._num_shared

    def is_idle(self, page: int) -> bool:
        return page in self._idle

    def match(self, keys: Seq[bytes]) -> list[int]:
        """The pages of the longest run of `keys`, from the first, that the cache has."""
        pages = []
        for key in keys:
            page = self._page.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def use(self, pages: Seq[int]) -> None:
        """A sequence starts using the cached `pages`."""
        for page in pages:
            self._users[page] += 1
            self._num_shared += self._users[page] == 2
            self._idle.pop(page, None)

    def unuse(self, pages: Seq[int]) -> None:
        """A sequence stops using the cached `pages` (given in its order): those no other uses
        become idle, the last page first, so that a prefix's deepest pages, which fewer prompts
        share, are evicted before the pages they extend."""
        for page in reversed(pages):
            self._users[page] -= 1
            self._num_shared -= self._users[page] == 1
            if self._users[page] == 0:
                self._idle[page] = None

    def insert(self, key: bytes, page: int) -> bool:
        """Cache `page` under `key`, used by the sequence that computed it; False (nothing
        changes) when the cache has that key already, in another page."""
        if key in self._page:
            return False
        self._page[key], self._key[page], self._users[page] = page, key, 1
        return True

    def evict(self) -> int:
        """Forget the least recently used idle page and return it (the caller drops it)."""
        page, _ = self._idle.popitem(last=False)
        del self._page[self._key.pop(page)], self._users[page]
        return page
