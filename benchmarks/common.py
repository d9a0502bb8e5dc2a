"""Timing and recording shared by the benchmark scripts (run them on the H200).

Kernel time is the CUPTI median over `iterations` calls of the same inputs (Mosaic GPU's
profiler, `jax.experimental.mosaic.gpu.profiler.measure`): every kernel of a call is summed,
launch gaps are not counted. Inputs are not rotated, so a case whose inputs fit in the L2 cache
(`L2_BYTES`) reads them from there after the first call; the decode suite marks such cases.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

from models.config import EngineConfig

L2_BYTES = 60 * 2**20


def kernel_time_ms(fn: Callable, *args, iterations: int = 20) -> float:
    """Median CUPTI kernel time of `fn(*args)` in ms (all kernels of one call summed).

    Falls back to wall-clock timing with `block_until_ready` where CUPTI is unavailable.
    """
    fn = _jitted(fn)
    jax.block_until_ready(fn(*args))
    try:
        from jax.experimental.mosaic.gpu import profiler

        _, times = profiler.measure(fn, iterations=iterations)(*args)
        return float(statistics.median(times))
    except Exception:  # noqa: BLE001 - CUPTI missing: time the step instead
        return step_time_ms(fn, *args, iterations=iterations)


def _jitted(fn: Callable) -> Callable:
    """`fn` under `jax.jit`, unless it is jitted already (one compilation for several timings)."""
    return fn if hasattr(fn, "lower") else jax.jit(fn)


def error_text(e: BaseException) -> str:
    """A failure as one line for a results record (exceptions may carry no message)."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:300]}" if lines else type(e).__name__


class Runner:
    """Times calls and records them; a failure becomes the record's error and the run goes on.

    `rate_key` names the rate a record gets (`work / ms / 1e9`: TB/s from bytes, TFLOP/s from
    FLOPs), `unit` its printed unit. Calls stop being started once `budget_s` has passed.
    """

    def __init__(self, budget_s: float, iterations: int, *, rate_key: str, unit: str):
        self.records: list[dict] = []
        self.deadline = time.monotonic() + budget_s
        self.iterations = iterations
        self.rate_key = rate_key
        self.unit = unit

    def over_budget(self) -> bool:
        return time.monotonic() > self.deadline

    def record(
        self, case: str, impl: str, variant: str, fn: Callable, *args, work: float, **info
    ) -> dict:
        record = dict(case=case, impl=impl, variant=variant, **info)
        try:
            ms = kernel_time_ms(fn, *args, iterations=self.iterations)
            record.update({"ms": ms, self.rate_key: work / ms / 1e9})
        except Exception as e:  # noqa: BLE001 - record and go on
            record["error"] = error_text(e)
        shown = (
            f"{record['ms']:.4f} ms  {record[self.rate_key]:.3g} {self.unit}"
            if "ms" in record
            else record["error"]
        )
        print(f"  {impl:13} {variant:28} {shown}", flush=True)
        self.records.append(record)
        return record


def step_time_ms(fn: Callable, *args, iterations: int = 20) -> float:
    """Median wall time of `fn(*args)` in ms, launch gaps included."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iterations):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times))


def environment() -> dict:
    """GPU name, jax version, git commit and date for a results file."""
    # The device machine gets the working tree without .git: the caller passes the commit.
    commit = os.environ.get("JAXPAGED_COMMIT") or _git_head()
    device = jax.devices()[0]
    return {
        "device": getattr(device, "device_kind", str(device)),
        "jax": jax.__version__,
        "commit": commit,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def _git_head() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--verify", "HEAD"], capture_output=True, text=True, check=False
        )
    except OSError:
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def write_results(path: str | Path, suite: str, cases: list[dict]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"suite": suite, **environment(), "cases": cases}, indent=1))


def print_table(cases: list[dict], columns: list[str]) -> None:
    widths = [max(len(c), *(len(_fmt(case.get(c))) for case in cases)) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    for case in cases:
        print("  ".join(_fmt(case.get(c)).ljust(w) for c, w in zip(columns, widths, strict=True)))


def _fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:.3g}"
    return "-" if x is None else str(x)


def roomy_engine_config(
    *,
    page_size: int,
    budget: int,
    max_seqs: int,
    max_len: int,
    chunk: int | None = None,
    mixed_step_tokens: tuple[int, ...] | None = None,
) -> EngineConfig:
    """The engine config of the end-to-end benchmarks: steps of `budget` tokens (prompt chunks
    of `chunk`, default the budget; mixed steps also of `mixed_step_tokens`), and a pool that
    holds all `max_seqs` slots at `max_len` tokens, so that nothing waits for pages."""
    return EngineConfig(
        page_size=page_size,
        num_pages=max_seqs * -(-max_len // page_size),
        max_seqs=max_seqs,
        max_tokens_per_step=budget,
        mixed_step_tokens=mixed_step_tokens,
        max_model_len=max_len,
        chunk_size=chunk or budget,
    )
