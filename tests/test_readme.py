"""The README's Python example runs as written; its backend table is the dispatch table."""

import re
from pathlib import Path

from jaxpaged import dispatch


def test_readme_example_runs():
    text = (Path(__file__).parent.parent / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README has no python example"
    namespace: dict = {}  # later blocks continue the first one, as a reader would
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102
    assert namespace["out"].shape == (6, 8, 128)
    assert bool(namespace["ok"])
    assert namespace["y"].shape == (15, 256) and bool(namespace["reserved"])
    assert [len(o) for o in namespace["outputs"]] == [8, 8]
    assert [len(o) for o in namespace["samples"]] == [8, 8, 8]


def test_backend_table_is_the_dispatch_table():
    """The README's backend table is `jaxpaged.dispatch.TABLE` as `backend_table()` prints
    it; after changing the table, paste that output between the markers."""
    text = (Path(__file__).parent.parent / "README.md").read_text()
    start = "<!-- backend-table: jaxpaged.dispatch.backend_table() -->\n"
    table = text[text.index(start) + len(start) : text.index("\n<!-- end of backend-table -->")]
    assert table == dispatch.backend_table(), dispatch.backend_table()
