"""The README's example runs (in the interpreter on CPU)."""

from __future__ import annotations

import pathlib
import re


def test_readme_example_runs():
    text = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    assert namespace["out"].shape == (1, 40, 4, 32)
    assert namespace["lse"].shape == (1, 4, 40)
    assert namespace["grads"].shape == (1, 40, 4, 32)
