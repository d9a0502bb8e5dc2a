"""Continuous batching on the host: which sequences run in the next step with how many tokens,
and who waits or is preempted when pages run out. No JAX here; the engine turns a plan into the
step's arrays.

Policy (vLLM-like): running sequences go first, oldest first, each with its next chunk (one
token once its prompt is cached); waiting sequences are admitted, oldest first, while the token
budget, a slot and pages for their first chunk are left. When a running sequence needs a page
and none is free, the newest running sequences are preempted (their pages released, their
tokens recomputed from scratch when they are admitted again) until it fits, so the oldest
sequence always makes progress.

A request of n samples (`SamplingParams.n`) is one sequence, sample 0, until its prompt is
cached: it is admitted with n slots, the other n - 1 held for its samples. The step that
completes the prompt draws all n first tokens from the prompt's last logits, and the engine
then forks samples 1..n-1 from sample 0 (`jaxpaged.fork`): they share the prompt's full pages.
From then on each sample is a sequence of its own; one that is preempted drops its references
and is recomputed alone. Page counts count a shared page once.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import math

import numpy as np

from models.config import EngineConfig
from models.prefix_cache import PrefixCache, page_keys


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    max_new_tokens: >= 1, the most tokens it generates (prompt + max_new_tokens must fit the
      engine's max_model_len).
    temperature: >= 0; 0 is greedy (top_k and top_p are then ignored).
    top_k: >= 0; sample among the k most likely tokens, 0 for all of them.
    top_p: in (0, 1]; then among the smallest set of most likely tokens holding top_p of the
      probability (nucleus sampling), 1 for all of them.
    seed: in [0, 2**32); a request's samples depend only on its seed and positions, not on
      what else shares its steps or how many decode steps a block runs.
    stop_token_ids: tokens (e.g. EOS) that end the request once generated; the stop token is
      the last token of its output.
    n: >= 1, independent samples of the prompt, which is computed once for all of them. Sample
      i draws with seed `(seed + i) % 2**32` and gives exactly what a request with
      `for_sample(i)` (that seed, n=1) gives.
    Invalid values raise `ValueError` when the params are made.
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    seed: int = 0
    top_k: int = 0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1

    def __post_init__(self):
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        rules = (
            ("max_new_tokens", _is_int(self.max_new_tokens) and self.max_new_tokens >= 1, ">= 1"),
            ("temperature", math.isfinite(self.temperature) and self.temperature >= 0, ">= 0"),
            ("top_k", _is_int(self.top_k) and self.top_k >= 0, "an int >= 0 (0: off)"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1] (1: off)"),
            ("seed", _is_int(self.seed) and 0 <= self.seed < 2**32, "an int in [0, 2**32)"),
            (
                "stop_token_ids",
                all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
                "token ids >= 0",
            ),
            ("n", _is_int(self.n) and self.n >= 1, "an int >= 1"),
        )
        for name, ok, rule in rules:
            if not ok:
                raise ValueError(
                    f"SamplingParams.{name} must be {rule}; got {getattr(self, name)!r}"
                )

    def for_sample(self, i: int) -> SamplingParams:
        """The params of sample i of this request as a request of its own: seed
        `(seed + i) % 2**32`, n=1."""
        return dataclasses.replace(self, seed=(self.seed + i) % 2**32, n=1)


def _is_int(value) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


@dataclasses.dataclass(eq=False)
class Sequence:
    """One sample of a request. `tokens` is the prompt followed by the tokens generated so far;
    the first `num_cached` of them have their K/V in the pages of pool slot `slot` (-1 while not
    running). `logprobs[i]` is the log-probability of generated token i under the model
    (temperature 1). `prompt_logits` [prompt_len, vocab], filled when the engine records them:
    row p is the prediction after prompt token p. `output_logits[i]` f32[vocab], recorded with
    them: the logits generated token i was chosen from (so `output_logits[0]` is
    `prompt_logits[-1]`).

    `samples` lists the request's n sequences in sample order (`SamplingParams.n`; `[self]`
    when n is 1), the same list in each of them; this one is `samples[sample_index]`, and its
    `params` are the request's `for_sample(sample_index)`."""

    id: int
    tokens: list[int]
    prompt_len: int
    params: SamplingParams
    slot: int = -1
    num_cached: int = 0
    logprobs: list[float] = dataclasses.field(default_factory=list)
    prompt_logits: np.ndarray | None = None
    output_logits: list[np.ndarray] = dataclasses.field(default_factory=list)
    sample_index: int = 0
    samples: list[Sequence] = dataclasses.field(default_factory=list, repr=False)

    def __post_init__(self):
        if not self.samples:
            self.samples = [self]

    @property
    def output(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def tokens_left(self) -> int:
        """The tokens it may still generate (`max_new_tokens` less its output)."""
        return self.params.max_new_tokens - len(self.output)

    @property
    def finish_reason(self) -> str | None:
        """ "stop" once it generated a stop token, "length" at max_new_tokens, else None."""
        generated = len(self.tokens) - self.prompt_len
        if generated and self.tokens[-1] in self.params.stop_token_ids:
            return "stop"
        return "length" if generated >= self.params.max_new_tokens else None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def unforked(self) -> list[Sequence]:
        """The samples to fork from this one once its prompt is cached: the request's others
        while this is sample 0 and has generated nothing, else none."""
        if self.sample_index or len(self.tokens) > self.prompt_len:
            return []
        return self.samples[1:]


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Tokens `start:start+length` of `seq` go through the model in this step."""

    seq: Sequence
    start: int
    length: int

    @property
    def samples(self) -> bool:
        """Whether the chunk ends at the sequence's last token, so its sample is a new token."""
        return self.start + self.length == len(self.seq.tokens)

    @property
    def is_decode(self) -> bool:
        return self.length == 1 and self.samples and self.start >= self.seq.prompt_len


@dataclasses.dataclass(frozen=True)
class Plan:
    """A step's chunks, row i of the step being `chunks[i]`.

    `forks` (set from the chunks when the plan is made) lists `(row, sample)`: the samples
    that start after this step, forked from the sequence of row `row`, whose chunk completes
    their request's prompt. The step samples their first tokens from that row's logits, in
    sample rows `len(chunks) + j` after the chunks' rows.
    """

    chunks: list[Chunk]
    # Prompt pages the admissions looked up in the prefix cache, and found there.
    prefix_queried: int = 0
    prefix_hits: int = 0
    forks: list[tuple[int, Sequence]] = dataclasses.field(init=False)

    def __post_init__(self):
        forks = [
            (row, sample)
            for row, c in enumerate(self.chunks)
            if c.samples
            for sample in c.seq.unforked
        ]
        object.__setattr__(self, "forks", forks)

    @property
    def decode(self) -> bool:
        """One token per sequence: the split-KV decode step can run it."""
        return all(c.length == 1 for c in self.chunks)


@dataclasses.dataclass(eq=False)
class _Shared:
    """The full pages that the running samples of one request hold in common since their fork
    and the prefix cache does not hold (`pages` of them, held by `holders` sequences)."""

    pages: int
    holders: int


class Scheduler:
    """Host-side state of continuous batching. The page counts mirror the pool's (a sequence of
    n cached tokens holds ceil(n / page_size) pages, a page held by several sequences or by the
    prefix cache is one page, and a fork takes a fresh page per new sample when the prompt's
    last page is partly filled), so plans fit the pool; the engine still checks the step's `ok`
    and calls `on_failed_step` if one did not, and `on_failed_fork` if a fork did not.

    With `EngineConfig.prefix_caching`, the full pages of every prompt go to the prefix cache
    once computed (`to_retain`); an admitted request starts on the cached pages of its prompt's
    longest cached prefix (`to_attach`), leaving at least its last token to compute, and idle
    cached pages are evicted (`to_evict`) before any sequence is preempted for pages. The
    engine applies `to_release`, `to_evict` and `to_attach` in that order before a step, and
    `to_retain`, then `to_fork`, then `to_release` after it. Until it releases them, the
    slots in `to_release` still hold `releasing_pages` pages that no one else holds: the pool
    holds `num_held_pages() + releasing_pages`.
    """

    def __init__(self, config: EngineConfig):
        self.page_size = config.page_size
        self.num_pages = config.num_pages
        self.max_tokens = config.max_tokens_per_step
        self.chunk_size = config.chunk_size or config.max_tokens_per_step
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []  # oldest first; forked samples after their source
        self.free_slots = list(range(config.max_seqs))
        self.to_release: list[int] = []  # slots the engine must release before the next step
        self.releasing_pages = 0  # the pages releasing them frees (held by no one else)
        # (source slot, samples): forks the engine must run before releasing slots.
        self.to_fork: list[tuple[int, list[Sequence]]] = []
        self.to_attach: list[tuple[int, list[int]]] = []  # (slot, cached pages to start it on)
        self.to_evict: list[int] = []  # cached pages to drop
        self.to_retain: list[int] = []  # pages newly cached
        self.num_preemptions = 0
        self.cache = PrefixCache() if config.prefix_caching else None
        self._hold_admission = False
        self._shared: dict[Sequence, _Shared] = {}
        self._cached: dict[Sequence, list[int]] = {}  # cached pages each running sequence holds
        self._keys: dict[Sequence, list[bytes]] = {}  # its prompt's page keys, once computed

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _pages(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def may_share_pages(self) -> bool:
        """Whether two running sequences hold the same pages: samples of one request still
        holding their fork's pages together, or cached pages that two running sequences use.
        The engine's decode takes its shared-prefix path only then."""
        forked = any(g.holders > 1 for g in self._shared.values())
        return forked or (self.cache is not None and self.cache.num_shared > 0)

    def num_held_pages(self) -> int:
        """The pages the running sequences and the prefix cache hold, each counted once."""
        held = sum(self._pages(s.num_cached) - len(self._cached.get(s, ())) for s in self.running)
        groups = {id(g): g for g in self._shared.values()}
        held -= sum(g.pages * (g.holders - 1) for g in groups.values())
        return held + (self.cache.num_pages if self.cache is not None else 0)

    def holds_growth(self, plan: Plan, tokens: int) -> bool:
        """Whether the pool holds `tokens` more tokens of every chunk's sequence beside the
        pages the step of `plan` takes (a decode block enqueued behind that step, before the
        host has counted it)."""
        pages = self._pages
        step = sum(pages(c.start + c.length) - pages(c.start) for c in plan.chunks)
        ends = [c.start + c.length for c in plan.chunks]
        growth = sum(pages(end + tokens) - pages(end) for end in ends)
        return growth <= self.num_pages - self.num_held_pages() - step

    def _need(self, seq: Sequence, start: int, n: int) -> int:
        """The free pages that caching tokens `start:start + n` of `seq` takes, with the copies
        of its prompt's partly filled last page when that completes the prompt of an n-sample
        request (forks happen only when a sample can generate a second token)."""
        need = self._pages(start + n) - self._pages(start)
        if start + n == len(seq.tokens) and seq.params.max_new_tokens > 1:
            need += len(seq.unforked) * (len(seq.tokens) % self.page_size != 0)
        return need

    def _idle(self) -> int:
        return self.cache.num_idle if self.cache is not None else 0

    def _evict(self) -> int:
        self.to_evict.append(self.cache.evict())
        return 1

    def schedule(self) -> Plan:
        budget = self.max_tokens
        free = self.num_pages - self.num_held_pages()
        chunks: list[Chunk] = []
        preempted = self._hold_admission
        self._hold_admission = False
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.slot < 0:  # preempted while planning this step
                continue
            n = min(len(seq.tokens) - seq.num_cached, self.chunk_size, budget)
            need = self._need(seq, seq.num_cached, n)
            while need > free and (self._idle() or self.running[-1] is not seq):
                if self._idle():
                    free += self._evict()
                else:
                    free += self.preempt(self.running[-1])
                    preempted = True
            if need > free:  # the newest sequence cannot fit next to the older ones
                self.preempt(seq)
                preempted = True
                continue
            free -= need
            budget -= n
            chunks.append(Chunk(seq, seq.num_cached, n))
        queried = hits = 0
        # No admissions after a preemption: the pages just freed belong to the older sequences.
        while not preempted and self.waiting and budget > 0:
            seq = self.waiting[0]
            keys = self._prompt_keys(seq)
            cached = self.cache.match(keys) if self.cache is not None else []
            start = len(cached) * self.page_size
            n = min(len(seq.tokens) - start, self.chunk_size, budget)
            need = self._need(seq, start, n)
            # Its cached pages stop being idle: they cannot be evicted for it.
            evictable = self._idle() - sum(self.cache.is_idle(p) for p in cached)
            # A request of n samples takes a slot for each.
            if len(self.free_slots) < 1 + len(seq.unforked) or need > free + evictable:
                break
            self.waiting.popleft()
            seq.slot = heapq.heappop(self.free_slots)
            for sample in seq.unforked:
                sample.slot = heapq.heappop(self.free_slots)
            if self.cache is not None:
                self.cache.use(cached)
                self._cached[seq] = cached
                queried, hits = queried + len(keys), hits + len(cached)
            if cached:
                self.to_attach.append((seq.slot, cached))
            while need > free:
                free += self._evict()
            free -= need
            seq.num_cached = start
            self.running.append(seq)
            budget -= n
            chunks.append(Chunk(seq, start, n))
        return Plan(chunks, prefix_queried=queried, prefix_hits=hits)

    def _page_keys(self, seq: Sequence) -> list[bytes]:
        """The keys of the prompt's full pages (computed once per sequence)."""
        if seq not in self._keys:
            self._keys[seq] = page_keys(seq.tokens[: seq.prompt_len], self.page_size)
        return self._keys[seq]

    def _prompt_keys(self, seq: Sequence) -> list[bytes]:
        """The keys of the prompt's full pages that an admission may take from the cache:
        all but the page of its last token, which must be computed for its logits."""
        if self.cache is None:
            return []
        return self._page_keys(seq)[: (len(seq.tokens) - 1) // self.page_size]

    def preempt(self, seq: Sequence) -> int:
        """Stop `seq`, queue its slot for release and put it first in line; returns the pages
        this frees (a shared page only with its last holder, a cached page not). It keeps its
        tokens and recomputes their K/V (or takes them from the cache) when admitted again."""
        freed = self._pages(seq.num_cached) - self._leave_shared(seq)
        self.running.remove(seq)
        self._free_slot(seq, freed)
        seq.num_cached = 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        return freed

    def on_failed_step(self) -> None:
        """The step's reservation failed, so it changed nothing: preempt the newest sequence and
        admit nobody next step, so that the older ones get its pages; evict every idle cached
        page too (the page counts were off, so the pool may be full of them)."""
        self.preempt(self.running[-1])
        self._hold_admission = True
        while self._idle():
            self._evict()

    def on_failed_fork(self, samples: list[Sequence]) -> None:
        """The pool could not hold the fork that was to start `samples` (it changed nothing):
        they wait, first in line, and compute their prompt (and first token) on their own."""
        for seq in reversed(samples):
            self.preempt(seq)

    def update(
        self,
        plan: Plan,
        tokens: np.ndarray,
        logprobs: np.ndarray,
        page_indices: np.ndarray | None = None,
    ) -> list[Sequence]:
        """Record a successful step: chunk i's sample is `tokens[i]`, and `plan.forks[j]`'s is
        `tokens[len(plan.chunks) + j]`. The forked samples that may generate more run after
        their source, queued in `to_fork`. With the prefix cache, `page_indices` is the pool's
        page table after the step ([max_seqs, pages_per_seq]): the prompt pages the step filled
        are cached, queued in `to_retain`. Returns finished sequences, whose slots are queued
        for release."""
        finished = []
        forks = collections.defaultdict(list)
        for j, (row, sample) in enumerate(plan.forks, len(plan.chunks)):
            forks[row].append((sample, j))
        for i, chunk in enumerate(plan.chunks):
            seq = chunk.seq
            if seq.slot < 0:  # preempted since the step was planned (after a failed step)
                continue
            seq.num_cached += chunk.length
            if self.cache is not None and chunk.start < seq.prompt_len:
                self._cache_pages(chunk, page_indices[seq.slot])
            if not chunk.samples:
                continue
            seq.tokens.append(int(tokens[i]))
            seq.logprobs.append(float(logprobs[i]))
            if forks[i]:
                finished += self._start_samples(seq, forks[i], tokens, logprobs)
            if seq.finished:
                self._finish(seq)
                finished.append(seq)
        return finished

    def cache_prompt_pages(self, chunks: list[Chunk], page_indices: np.ndarray) -> None:
        """With the prefix cache, cache the prompt pages that `chunks` filled, of a step whose
        chunks were counted as cached when it was enqueued (`page_indices`: the pool's page
        table after it)."""
        if self.cache is None:
            return
        for chunk in chunks:
            if chunk.start < chunk.seq.prompt_len:
                self._cache_pages(chunk, page_indices[chunk.seq.slot])

    def _cache_pages(self, chunk: Chunk, pages: np.ndarray) -> None:
        """Cache the prompt pages that `chunk` filled (`pages`: its sequence's page table row),
        unless the cache has their prefixes in other pages already."""
        seq = chunk.seq
        keys = self._page_keys(seq)
        end = min(chunk.start + chunk.length, seq.prompt_len) // self.page_size
        for k in range(chunk.start // self.page_size, end):
            page = int(pages[k])
            if self.cache.insert(keys[k], page):
                self._cached[seq].append(page)
                self.to_retain.append(page)

    def _start_samples(self, seq, samples, tokens, logprobs) -> list[Sequence]:
        """Give `seq`'s forked samples their first tokens; those that may generate more run
        right after it, holding its prompt's full pages with it. Returns the finished ones."""
        finished, started = [], []
        for sample, j in samples:
            sample.tokens.append(int(tokens[j]))
            sample.logprobs.append(float(logprobs[j]))
            if sample.finished:  # never in the pool: its slot needs no release
                heapq.heappush(self.free_slots, sample.slot)
                sample.slot = -1
                finished.append(sample)
            else:
                sample.num_cached = seq.num_cached
                started.append(sample)
        if started:
            at = self.running.index(seq) + 1
            self.running[at:at] = started
            cached = self._cached.get(seq, [])
            for sample in started:
                if self.cache is not None:
                    self.cache.use(cached)
                    self._cached[sample] = list(cached)
            shared = _Shared(seq.num_cached // self.page_size - len(cached), 1 + len(started))
            for s in (seq, *started):
                self._shared[s] = shared
            self.to_fork.append((seq.slot, started))
        return finished

    def update_block(
        self, rows: list[Sequence], tokens: np.ndarray, logprobs: np.ndarray, counts: np.ndarray
    ) -> list[Sequence]:
        """Record a decode block: row s (`rows[s]`) generated `tokens[:counts[s], s]`, caching
        the token it started from and all but the last of them. Returns finished sequences,
        whose slots are queued for release."""
        finished = []
        for s, seq in enumerate(rows):
            n = int(counts[s])
            if n == 0:
                continue
            seq.num_cached += n
            seq.tokens.extend(int(t) for t in tokens[:n, s])
            seq.logprobs.extend(float(p) for p in logprobs[:n, s])
            if seq.finished:
                self._finish(seq)
                finished.append(seq)
        return finished

    def _finish(self, seq: Sequence) -> None:
        freed = self._pages(seq.num_cached) - self._leave_shared(seq)
        self.running.remove(seq)
        self._free_slot(seq, freed)
        self._keys.pop(seq, None)

    def _leave_shared(self, seq: Sequence) -> int:
        """Drop `seq` from the holders of its pages that others hold too (other samples of its
        request, the prefix cache); returns how many of its pages stay held by them."""
        cached = self._cached.pop(seq, [])
        if self.cache is not None:
            self.cache.unuse(cached)
        shared = self._shared.pop(seq, None)
        if shared is None:
            return len(cached)
        shared.holders -= 1
        return len(cached) + (shared.pages if shared.holders else 0)

    def _free_slot(self, seq: Sequence, freed: int) -> None:
        self.to_release.append(seq.slot)
        self.releasing_pages += freed
        heapq.heappush(self.free_slots, seq.slot)
        for sample in seq.unforked:  # slots held for samples not forked yet
            heapq.heappush(self.free_slots, sample.slot)
            sample.slot = -1
        seq.slot = -1
