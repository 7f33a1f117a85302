"""The README's example runs and prints what its comments say."""

import contextlib
import io
import pathlib
import re

README = pathlib.Path(__file__).parents[1] / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


def test_readme_example_runs_and_prints_its_comments():
    (code,) = _python_blocks()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(README), "exec"), {})
    printed = [
        " ".join(line.split()) for line in out.getvalue().replace("]\n [", "] [").splitlines()
    ]
    expected = [
        " ".join(comment.split())
        for line in code.splitlines()
        if line.startswith("print(") and (comment := line.partition("# ")[2])
    ]
    assert printed == expected
