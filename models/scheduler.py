"""Continuous batching on the host: which sequences run in the next step with how many tokens,
and who waits or is preempted when pages run out. No JAX here; the engine turns a plan into the
step's arrays.

Policy (vLLM-like): running sequences go first, oldest first, each with its next chunk (one
token once its prompt is cached); waiting sequences are admitted, oldest first, while the token
budget, a slot and pages for their first chunk are left. When a running sequence needs a page
and none is free, the newest running sequences are preempted (their pages released, their
tokens recomputed from scratch when they are admitted again) until it fits, so the oldest
sequence always makes progress.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import math

import numpy as np

from models.config import EngineConfig


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
    Invalid values raise `ValueError` when the params are made.
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    seed: int = 0
    top_k: int = 0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()

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
        )
        for name, ok, rule in rules:
            if not ok:
                raise ValueError(
                    f"SamplingParams.{name} must be {rule}; got {getattr(self, name)!r}"
                )


def _is_int(value) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


@dataclasses.dataclass(eq=False)
class Sequence:
    """One request. `tokens` is the prompt followed by the tokens generated so far; the first
    `num_cached` of them have their K/V in the pages of pool slot `slot` (-1 while not running).
    `logprobs[i]` is the log-probability of generated token i under the model (temperature 1).
    `prompt_logits` [prompt_len, vocab], filled when the engine records them: row p is the
    prediction after prompt token p. `output_logits[i]` f32[vocab], recorded with them: the
    logits generated token i was chosen from (so `output_logits[0]` is `prompt_logits[-1]`)."""

    id: int
    tokens: list[int]
    prompt_len: int
    params: SamplingParams
    slot: int = -1
    num_cached: int = 0
    logprobs: list[float] = dataclasses.field(default_factory=list)
    prompt_logits: np.ndarray | None = None
    output_logits: list[np.ndarray] = dataclasses.field(default_factory=list)

    @property
    def output(self) -> list[int]:
        return self.tokens[self.prompt_len :]

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
    chunks: list[Chunk]

    @property
    def decode(self) -> bool:
        """One token per sequence: the split-KV decode step can run it."""
        return all(c.length == 1 for c in self.chunks)


class Scheduler:
    """Host-side state of continuous batching. The page counts mirror `jaxpaged.reserve`'s
    accounting (a sequence of n cached tokens owns ceil(n / page_size) pages), so plans fit the
    pool; the engine still checks the step's `ok` and calls `on_failed_step` if one did not."""

    def __init__(self, config: EngineConfig):
        self.page_size = config.page_size
        self.num_pages = config.num_pages
        self.max_tokens = config.max_tokens_per_step
        self.chunk_size = config.chunk_size or config.max_tokens_per_step
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []  # oldest first
        self.free_slots = list(range(config.max_seqs))
        self.to_release: list[int] = []  # slots the engine must release before the next step
        self.num_preemptions = 0
        self._hold_admission = False

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _pages(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def schedule(self) -> Plan:
        budget = self.max_tokens
        free = self.num_pages - sum(self._pages(s.num_cached) for s in self.running)
        chunks: list[Chunk] = []
        preempted = self._hold_admission
        self._hold_admission = False
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.slot < 0:  # preempted while planning this step
                continue
            n = min(len(seq.tokens) - seq.num_cached, self.chunk_size, budget)
            need = self._pages(seq.num_cached + n) - self._pages(seq.num_cached)
            while need > free and self.running[-1] is not seq:
                free += self.preempt(self.running[-1])
                preempted = True
            if need > free:  # the newest sequence cannot fit next to the older ones
                self.preempt(seq)
                preempted = True
                continue
            free -= need
            budget -= n
            chunks.append(Chunk(seq, seq.num_cached, n))
        # No admissions after a preemption: the pages just freed belong to the older sequences.
        while not preempted and self.waiting and self.free_slots and budget > 0:
            seq = self.waiting[0]
            n = min(len(seq.tokens), self.chunk_size, budget)
            if self._pages(n) > free:
                break
            self.waiting.popleft()
            seq.slot = heapq.heappop(self.free_slots)
            self.running.append(seq)
            free -= self._pages(n)
            budget -= n
            chunks.append(Chunk(seq, 0, n))
        return Plan(chunks)

    def preempt(self, seq: Sequence) -> int:
        """Stop `seq`, queue its slot for release and put it first in line; returns the pages it
        held. It keeps its tokens and recomputes their K/V when admitted again."""
        freed = self._pages(seq.num_cached)
        self.running.remove(seq)
        self._free_slot(seq)
        seq.num_cached = 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        return freed

    def on_failed_step(self) -> None:
        """The step's reservation failed, so it changed nothing: preempt the newest sequence and
        admit nobody next step, so that the older ones get its pages."""
        self.preempt(self.running[-1])
        self._hold_admission = True

    def update(self, plan: Plan, tokens: np.ndarray, logprobs: np.ndarray) -> list[Sequence]:
        """Record a successful step: chunk i's sample is `tokens[i]`. Returns finished
        sequences, whose slots are queued for release."""
        finished = []
        for i, chunk in enumerate(plan.chunks):
            seq = chunk.seq
            seq.num_cached += chunk.length
            if not chunk.samples:
                continue
            seq.tokens.append(int(tokens[i]))
            seq.logprobs.append(float(logprobs[i]))
            if seq.finished:
                self.running.remove(seq)
                self._free_slot(seq)
                finished.append(seq)
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
                self.running.remove(seq)
                self._free_slot(seq)
                finished.append(seq)
        return finished

    def _free_slot(self, seq: Sequence) -> None:
        self.to_release.append(seq.slot)
        heapq.heappush(self.free_slots, seq.slot)
        seq.slot = -1
