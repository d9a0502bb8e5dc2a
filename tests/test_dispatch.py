"""The dispatch table (jaxpaged/dispatch.py): what `implementation=None` picks on a pretend H200,
A100 and CPU, the rule for many short decode sequences, and that the Mosaic GPU kernels stand
without the Triton folder."""

import ast
import pathlib

import jax.numpy as jnp
import pytest

import jaxpaged
from jaxpaged import dispatch

H200 = dispatch.Device("gpu", "9.0", 132)
A100 = dispatch.Device("gpu", "8.0", 108)
CPU = dispatch.Device("cpu", None, None)
BF16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)


def _decode(num_seqs, max_kv_len, dtype=BF16, head_dim=128, page_size=16):
    return dispatch.Call(dtype, head_dim, page_size, num_seqs, 8, max_kv_len)


@pytest.mark.parametrize(
    "call,on_h200",
    [
        (_decode(1, 32768), "mosaic"),
        (_decode(64, 4096), "mosaic"),
        (_decode(8, 512), "mosaic"),
        (_decode(64, 512), "triton"),  # many short sequences
        (_decode(64, 1024), "mosaic"),
        (dispatch.Call(BF16, 128, 16), "mosaic"),  # batch shape not given
        (_decode(1, 32768, dtype=F32), "triton"),
        (_decode(1, 32768, head_dim=96), "triton"),
        (_decode(1, 32768, page_size=12), "triton"),
        (_decode(1, 32768, head_dim=256, page_size=128), "triton"),  # 128 > block_kv 64
    ],
    ids=str,
)
def test_decode_picks(call, on_h200):
    assert dispatch.choose("decode", call, H200) == on_h200
    assert dispatch.choose("decode", call, A100) == "triton"
    assert dispatch.choose("decode", call, CPU) == "xla"


@pytest.mark.parametrize(
    "dtype,head_dim,page_size,on_h200",
    [
        (BF16, 128, 16, "mosaic"),
        (jnp.dtype(jnp.float16), 64, 64, "mosaic"),
        (BF16, 256, 64, "mosaic"),
        (BF16, None, None, "mosaic"),
        (F32, 128, 16, "triton"),
        (BF16, 96, 16, "triton"),
        (BF16, 128, 12, "triton"),
        (jnp.dtype(jnp.float16), 64, 256, "triton"),
    ],
)
def test_ragged_picks(dtype, head_dim, page_size, on_h200):
    call = dispatch.Call(dtype, head_dim, page_size)
    assert dispatch.choose("ragged", call, H200) == on_h200
    assert dispatch.choose("ragged", call, A100) == "triton"
    assert dispatch.choose("ragged", call, CPU) == "xla"


@pytest.mark.parametrize(
    "num_seqs,max_kv_len,expected",
    [
        (64, 512, True),  # the decode suite's cases where the Triton kernel is ahead
        (34, 512, True),  # 272 items: more than two per SM
        (33, 512, False),  # 264: two per SM
        (32, 512, False),
        (64, 1024, False),
        (256, 1024, False),
        (64, 2048, False),
        (8, 512, False),
        (1, 32768, False),
        (256, 4096, False),
    ],
)
def test_many_short_sequences(num_seqs, max_kv_len, expected):
    assert dispatch.many_short_sequences(num_seqs, 8, max_kv_len, num_sms=132) is expected


def test_availability():
    """The Mosaic kernels are offered on GPUs only; the Triton ones everywhere (interpret mode
    off-GPU), but `None` takes them on GPUs only."""
    for op in dispatch.OPS:
        assert dispatch.available(op, H200) == ("mosaic", "triton", "xla")
        assert dispatch.available(op, CPU) == ("triton", "xla")
        assert [row.name for row in dispatch.backends(op)][-1] == "xla"
        for row in dispatch.backends(op):
            assert callable(dispatch.load(op, row.name))


def test_resolve_implementation_here():
    """`resolve_implementation` is the table's pick for the default device; explicit names
    are checked."""
    device = dispatch.default_device()
    call = _decode(64, 512)
    assert jaxpaged.resolve_implementation(
        "decode", None, BF16, **dict(zip(call._fields[1:], call[1:], strict=True))
    ) == dispatch.choose("decode", call, device)
    assert jaxpaged.resolve_implementation("ragged", "xla") == "xla"
    with pytest.raises(ValueError, match="'cuda-magic' is unknown"):
        jaxpaged.resolve_implementation("ragged", "cuda-magic")
    with pytest.raises(TypeError, match="unexpected"):
        jaxpaged.resolve_implementation("ragged", None, BF16, num_seqs=4)
    with pytest.raises(TypeError, match="unexpected"):
        jaxpaged.resolve_implementation("decode", None, BF16, batch=4)


def test_without_triton(monkeypatch):
    """With the Triton folder gone, its rows are unavailable and nothing else changes."""
    exists = dispatch._module_exists
    monkeypatch.setattr(
        dispatch,
        "_module_exists",
        lambda module: not module.startswith("pallas_kernels.triton") and exists(module),
    )
    assert dispatch.available("decode", H200) == ("mosaic", "xla")
    assert dispatch.choose("decode", _decode(1, 32768), H200) == "mosaic"
    assert dispatch.choose("decode", _decode(1, 32768, dtype=F32), H200) == "xla"
    assert dispatch.choose("ragged", dispatch.Call(BF16, 128, 16), H200) == "mosaic"


def test_mosaic_imports_nothing_from_triton():
    """Deleting pallas_kernels/triton/ (and its table rows) leaves the Mosaic GPU backend whole."""
    mosaic = pathlib.Path(__file__).parent.parent / "pallas_kernels" / "mosaic"
    for path in mosaic.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            assert not any(n.startswith("pallas_kernels.triton") for n in names), path
