"""The benchmark harness end to end on tiny shapes (interpret mode), the results loader and the
README's summary table."""

import json
import types
from pathlib import Path

import matplotlib
import numpy as np
import pytest
from flax import nnx

from benchmarks import attention, inputs, results, serving, sharing, summary
from models.config import CONFIGS
from models.decoder import Decoder
from models.engine import Engine
from models.scheduler import SamplingParams

matplotlib.use("Agg")
ROOT = Path(__file__).resolve().parent.parent


def test_readme_table_is_the_summary_of_the_recorded_results():
    block = summary.readme_block((ROOT / "README.md").read_text())
    assert block == summary.markdown(), "run `python -m benchmarks.summary --write-readme`"


def test_smoke_suites_write_results_that_load_plot_and_summarize(tmp_path):
    attention.main(
        ["--suite", *attention.SUITES, "--smoke", "--out", f"{tmp_path}/h200_{{suite}}.json"]
    )
    for suite in attention.SUITES:
        data = json.loads((tmp_path / f"h200_{suite}.json").read_text())
        assert {"device", "jax", "commit", "date", "cases"} <= data.keys()
        measured = [c for c in data["cases"] if "ms" in c]
        if suite == "shared_prefix":  # the XLA reference in smoke runs, against two anchors
            assert {c["impl"] for c in measured} == {"xla", "private", "plain"}
        else:
            assert any(c["impl"] == "triton" for c in measured), suite
        assert all("error" in c for c in data["cases"] if "ms" not in c)
    decode = results.load("decode", tmp_path)
    assert all("tb_s" in c and "page_size" in c for c in decode.measured("triton"))
    assert any("vs_xla" in c for c in decode.measured("triton"))
    results.plot_decode(decode)
    results.plot_prefill(results.load("prefill", tmp_path))
    text = summary.markdown(tmp_path)
    assert "**Decode**" in text and "**Prefill**" in text and "**Mixed batches**" in text


def test_sharing_smoke_shares_pages_and_prompts_and_changes_no_token(tmp_path):
    """The tiny rollout (2 prompts of 40 tokens, 4 samples, 12 new tokens; every request
    admitted in the first step) peaks at its arithmetic's pages: 8 x 4 private, 2 x 2 shared
    + 8 x 2 own (a copy of the partly filled prompt page, a generated one); the shared prompt
    is prefilled once per prompt and the samples give the private requests' tokens. The warm
    prefix cache computes only the 7 timed requests' suffixes; no output changes."""
    cases = sharing.main(["--smoke", "--out", str(tmp_path / "h200_sharing.json")])
    assert json.loads((tmp_path / "h200_sharing.json").read_text())["cases"] == cases
    rollout = {c["mode"]: c for c in cases if c["kind"] == "rollout"}
    private = rollout.pop("private")
    assert (private["peak_pages"], private["best_pages"], private["prefill_tokens"]) == (
        32,
        32,
        320,
    )
    assert rollout, "no shared mode"
    for shared in rollout.values():
        assert (shared["peak_pages"], shared["best_pages"], shared["pages_ratio"]) == (20, 20, 1.6)
        assert (shared["prefill_tokens"], shared["forked_samples"]) == (80, 6)
        assert shared["same_tokens_as_private"] == 1.0 and shared["preemptions"] == 0
    prefix = {(c["prefix_caching"], c["arrival"]): c for c in cases if c["kind"] == "prefix"}
    assert prefix.keys() == {(cached, a) for cached in (False, True) for a in ("cold", "warm")}
    assert all(c["same_tokens_as_no_cache"] == 1.0 for c in prefix.values())
    assert prefix[False, "warm"]["prefill_tokens"] == 7 * 56
    assert prefix[True, "warm"]["prefill_tokens"] == 7 * 8
    assert prefix[True, "warm"]["prefix_hit_pages"] == 7 * 3
    assert prefix[False, "cold"]["prefix_hit_pages"] == 0 < prefix[True, "cold"]["prefix_hit_pages"]


def test_serving_smoke_times_every_request(tmp_path):
    """The tiny stream (8 requests of 40 tokens, 12 new tokens each, one every 5 ms at 4
    slots): every request's first token after its arrival, and its tokens those of the same
    prompts run at once (the serving loop changes no token, polling or waiting)."""
    cases = serving.main(["--smoke", "--out", str(tmp_path / "h200_serving.json")])
    assert json.loads((tmp_path / "h200_serving.json").read_text())["cases"] == cases
    [case] = cases
    assert 0 < case["ttft_p50_ms"] <= case["ttft_p90_ms"] <= case["ttft_max_ms"]
    assert case["ttft_mean_ms"] <= case["ttft_max_ms"] and case["tpot_ms"] > 0
    assert 1 <= case["mean_decode_rows"] <= 4 and case["mixed_steps"] >= 8 * 40 / 64
    assert case["output_tokens_per_s"] == pytest.approx(8 * 12 / (case["wall_ms"] / 1e3))
    sizes = types.SimpleNamespace(
        page_size=16, budget=64, max_seqs=4, prompt_len=40, new_tokens=12, mixed_step_tokens=None
    )
    engine = Engine(Decoder(CONFIGS["tiny"], rngs=nnx.Rngs(0)), serving._config(sizes))
    prompts = np.random.default_rng(1).integers(0, 97, (6, 40)).tolist()
    params = SamplingParams(12)
    want = [s.output for s in engine.generate(prompts, params)]
    for poll in (True, False):
        assert serving.serve(engine, prompts, params, 0.002, poll=poll)["outputs"] == want


def test_loader_reads_the_recorded_results():
    found = results.load_all()
    assert {"decode", "prefill"} <= found.keys()
    for suite, res in found.items():
        if suite == "e2e":  # engine throughput, not kernel times
            assert res.cases and all(c["tokens_per_s"] > 0 for c in res.cases), res.path
        else:
            assert res.measured(), res.path


def test_every_recorded_ratio_is_named_after_an_implementation_of_its_file():
    """One name per figure: a kernel speed ratio is `vs_<impl>` (anchor time / ours), with
    `impl` an implementation timed in the same file."""
    for path in results.RESULTS_DIR.glob("*.json"):
        data = json.loads(path.read_text())
        if data["suite"] in ("e2e", "sharing", "serving"):  # engine figures: vs_hf, vs_private, ...
            continue
        cases = data["cases"]
        ratios = {k for c in cases for k in c if k.startswith(("vs_", "x_"))}
        assert ratios <= {f"vs_{c['impl']}" for c in cases if "impl" in c}, path.name
        assert all("impl" in c for c in cases if "ms" in c), path.name


def test_loader_fails_loudly_without_results(tmp_path):
    with pytest.raises(FileNotFoundError):
        results.load("decode", tmp_path)
    with pytest.raises(FileNotFoundError):
        results.load_all(tmp_path)


def test_jax_k_splits_gives_two_programs_per_sm_within_the_pages():
    assert attention.jax_k_splits(64, 256) == 1
    assert attention.jax_k_splits(1, 2048) == 64
    assert attention.jax_k_splits(1, 8) == 8
    assert attention.jax_k_splits(8, 512) == 8


def test_decode_suite_skips_cases_beyond_the_kv_limit():
    cases = attention.decode_cases()
    assert all(
        inputs.kv_cache_bytes(c.batch * c.ctx) <= attention.MAX_DECODE_KV_BYTES for c in cases
    )
    assert [c.name for c in cases[: len(attention.DECODE_HEADLINE)]] == [
        c.name for c in attention.DECODE_HEADLINE
    ]
    assert len({c.name for c in cases}) == len(cases)


def test_e2e_prefill_cases_report_the_median_of_their_repeats():
    from benchmarks import e2e  # noqa: PLC0415

    argv = ["--smoke", "--no-baseline", "--batches", "--batch-prompts", "0", "--repeats", "2"]
    cases = [c for c in e2e.main(argv) if c.get("kind") == "prefill"]
    assert [c["chunk"] for c in cases] == ["single-shot", 16, 32]  # --smoke's chunks
    for case in cases:
        slowest, fastest = case["tokens_per_s_range"]
        assert case["repeats"] == 2 and slowest <= case["tokens_per_s"] <= fastest


def test_e2e_decode_reports_its_rate_after_the_first_block():
    """The steady rate covers the blocks after the first, inside the timed window."""
    from benchmarks import e2e  # noqa: PLC0415

    cases = [c for c in e2e.main(["--smoke", "--skip-prefill", "--no-baseline"]) if "batch" in c]
    assert [c["batch"] for c in cases] == [1, 4]  # --smoke's batches
    for case in cases:
        after_first = case["steps"] - case["decode_steps"]
        assert after_first > 0
        steady_ms = case["steady_ms_per_step"]
        assert 0 < steady_ms * after_first < case["wall_ms_per_step"] * case["steps"]
        assert case["steady_tokens_per_s"] == pytest.approx(case["batch"] * 1e3 / steady_ms)


def test_e2e_decode_variants_run_beside_the_same_anchors():
    """`--decode-variants`: each small decode batch once per variant (the layer path through
    its XLA structure here), in the slots the variant asks for; the engine's own minimum is
    back afterwards, and the README table names each variant."""
    from benchmarks import e2e  # noqa: PLC0415
    from models import engine  # noqa: PLC0415

    argv = ["--smoke", "--skip-prefill", "--implementation", "xla", "--batches", "1"]
    argv += ["--decode-variants", "plain", "layer-1slot"]
    cases = [c for c in e2e.main(argv) if c.get("kind") == "decode"]
    assert [(c["batch"], c["variant"]) for c in cases] == [
        (1, "plain"),
        (1, "layer-1slot"),
        (4, "plain"),
        (4, "layer-1slot"),
    ]
    assert [c["decode_rows"] for c in cases] == [2, 1, 4, 4]
    assert [c["layer_kernel"] for c in cases] == [False, True, False, True]
    assert cases[0]["baseline_tokens_per_s"] == cases[1]["baseline_tokens_per_s"]
    assert engine.MIN_DECODE_ROWS == e2e.DEFAULT_MIN_DECODE_ROWS
    assert engine.LAYER_PATH_MIN_DECODE_ROWS == e2e.DEFAULT_LAYER_PATH_ROWS
    table = "\n".join(summary.e2e_table(results.Results("e2e", Path("e.json"), {}, cases)))
    assert "decode B=1 ctx 40, XLA layers" in table
    assert "decode B=1 ctx 40, layer kernel, one slot" in table
