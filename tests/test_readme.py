"""The README's Python example runs as written."""

import re
from pathlib import Path


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
