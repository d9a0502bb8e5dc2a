"""Recorded benchmark results, loaded for the notebooks and the README summary.

`load(suite)` reads `benchmarks/results/h200_<suite>.json` (written by `benchmarks.attention`
or `benchmarks.e2e`) and raises `FileNotFoundError` when there is none: a plot of nothing is
never shown.

Kernel suites' records are dicts with `case`, `impl`, `variant`, `ms` (CUPTI median kernel
time), `tb_s` (decode: unique KV bytes / time) or `tflops` (prefill, mixed: attention FLOPs /
time) or `error`, the case's shape (decode: `batch`, `ctx`, `page_size`, `ragged`,
`l2_resident`; prefill: `num_seqs`, `q_len`, `kv_len`, `chunk`) and, on ours, `vs_<anchor>`
(anchor time / our time). `impl` is one of ours (`triton`, `mosaic`), an anchor
(`cudnn-paged`, `cudnn-dense`, `jax-pallas`, `mosaic-fa3`, `xla`), `ceiling`, or in mixed
batches the decode kernels and `parts` (the batch's parts run separately).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
HBM_PEAK_TB_S = 4.8  # H200 datasheet
# Quoted when a recording has no matmul ceiling of its own: XLA's bf16 8192^3 matmul, CUPTI
# median, measured on the H200 (benchmarks/NOTES.md, floors).
MATMUL_PEAK_TFLOPS = 812.0
OURS = ("triton", "mosaic")
ANCHORS = ("cudnn-paged", "cudnn-dense", "jax-pallas", "mosaic-fa3", "xla")
LABELS = {
    "triton": "Triton (ours)",
    "mosaic": "Mosaic GPU (ours)",
    "cudnn-paged": "cuDNN paged",
    "cudnn-dense": "cuDNN dense",
    "jax-pallas": "JAX Pallas paged_attention",
    "mosaic-fa3": "JAX Mosaic FA3 (fp16)",
    "xla": "XLA reference",
}


@dataclasses.dataclass
class Results:
    suite: str
    path: Path
    header: dict  # device, jax, commit, date, ...
    cases: list[dict]

    def source(self) -> str:
        """One line naming the file and where and when it was measured."""
        h = self.header
        commit = (h.get("commit") or "?")[:7]
        return (
            f"`benchmarks/results/{self.path.name}`: {h.get('device')}, jax {h.get('jax')}, "
            f"commit {commit}, {str(h.get('date', '?'))[:10]}"
        )

    def measured(self, impl: str | None = None) -> list[dict]:
        return [c for c in self.cases if "ms" in c and impl in (None, c["impl"])]

    def ceiling(self, case_prefix: str) -> dict | None:
        found = [c for c in self.measured("ceiling") if c["case"].startswith(case_prefix)]
        return found[0] if found else None

    def pick(self, impl: str) -> dict[str, dict]:
        """Per case, the record that stands for `impl`: our kernels' `default` variant where
        one was timed, otherwise (and for anchors) the fastest variant."""
        chosen: dict[str, dict] = {}
        for c in self.measured(impl):
            old = chosen.get(c["case"])
            if old is None or _rank(c) < _rank(old):
                chosen[c["case"]] = c
        return chosen


def _rank(record: dict) -> tuple:
    return (record.get("variant") != "default", record["ms"])


def load(suite: str, directory: Path = RESULTS_DIR) -> Results:
    """The recorded results of `suite` ("decode", "prefill", "mixed" or "e2e")."""
    path = Path(directory) / f"h200_{suite}.json"
    if not path.exists():
        raise FileNotFoundError(
            f"no {suite} results in {directory}: run `bash benchmarks/run_h200.sh {suite}-suite` "
            f"on the H200 and copy $OUT/h200_{suite}.json there"
        )
    data = json.loads(path.read_text())
    if not data["cases"]:
        raise FileNotFoundError(f"{path} has no {suite} cases")
    header = {k: v for k, v in data.items() if k != "cases"}
    return Results(suite, path, header, data["cases"])


def load_all(directory: Path = RESULTS_DIR) -> dict[str, Results]:
    """Every suite that has results; raises `FileNotFoundError` when none has."""
    found = {}
    for suite in ("decode", "prefill", "mixed", "e2e"):
        try:
            found[suite] = load(suite, directory)
        except FileNotFoundError:
            pass
    if not found:
        raise FileNotFoundError(f"no benchmark results in {directory}")
    return found


def decode_panels(res: Results) -> list[tuple[int, int]]:
    """(batch, page_size) of the uniform-length decode cases, sorted."""
    return sorted(
        {(c["batch"], c["page_size"]) for c in res.measured() if "ctx" in c and not c.get("ragged")}
    )


def plot_decode(res: Results):
    """TB/s of KV against context, one panel per (batch, page size), one line per
    implementation; hollow markers where the KV fits in L2; HBM ceilings as lines."""
    import matplotlib.pyplot as plt

    panels = decode_panels(res)
    if not panels:
        raise ValueError(f"{res.path} has no measured uniform-length decode case")
    cols = min(4, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.2 * rows), squeeze=False, sharey=True)
    copy = res.ceiling("hbm-copy")
    for ax, (batch, page) in zip(axes.flat, panels, strict=False):
        for impl in (*OURS, *ANCHORS):
            points = sorted(
                (c["ctx"], c["tb_s"], c.get("l2_resident", False))
                for c in res.pick(impl).values()
                if c.get("batch") == batch and c.get("page_size") == page and not c.get("ragged")
            )
            if not points:
                continue
            x, y, _ = zip(*points, strict=True)
            (line,) = ax.plot(x, y, "-", label=LABELS[impl])
            for xi, yi, in_l2 in points:
                color = line.get_color()
                ax.plot(xi, yi, "o", color=color, mfc="none" if in_l2 else color)
        ax.axhline(HBM_PEAK_TB_S, color="k", ls="--", lw=1, label="HBM peak (datasheet)")
        if copy:
            ax.axhline(
                copy["tb_s"], color="gray", ls=":", lw=1, label="XLA copy, read+write (measured)"
            )
        ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)
        ax.set_title(f"decode B={batch}, page {page}")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("TB/s of KV")
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize="small")
    fig.suptitle(
        f"{res.source().replace('`', '')}\nhollow markers: KV fits in the 60 MiB L2",
        fontsize="small",
    )
    fig.tight_layout(rect=(0, 0.08, 1, 0.95))
    return fig


def plot_prefill(res: Results):
    """TFLOP/s of one-sequence causal prompts against T, one line per implementation, with
    the matmul ceiling (this run's, else `MATMUL_PEAK_TFLOPS`)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    plotted = 0
    for impl in (*OURS, *ANCHORS):
        points = sorted(
            (c["q_len"], c["tflops"])
            for c in res.pick(impl).values()
            if c.get("num_seqs") == 1 and not c.get("chunk")
        )
        if points:
            ax.plot(*zip(*points, strict=True), "o-", label=LABELS[impl])
            plotted += 1
    if not plotted:
        raise ValueError(f"{res.path} has no measured B=1 causal prompt")
    matmul = res.ceiling("matmul")
    peak, label = (
        (matmul["tflops"], "bf16 matmul (this run)")
        if matmul
        else (MATMUL_PEAK_TFLOPS, "bf16 matmul (NOTES.md)")
    )
    ax.axhline(peak, color="k", ls="--", lw=1, label=f"{label}: {peak:.0f}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt length T (B=1, causal, q_len == kv_len)")
    ax.set_ylabel("TFLOP/s")
    ax.set_ylim(bottom=0)
    ax.set_title(res.source().replace("`", ""), fontsize="small")
    ax.legend(fontsize="small")
    fig.tight_layout()
    return fig
