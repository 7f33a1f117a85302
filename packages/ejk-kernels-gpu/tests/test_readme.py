"""The README's example runs (in the interpreter on CPU) and gives what the README states:
the values, lse and gradients of `ejk_sequtils.reference_attention` with the same arguments."""

from __future__ import annotations

import pathlib
import re

import jax

from ejk_sequtils import reference_attention


def test_readme_example_runs(close):
    text = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    q, k, v = (namespace[name] for name in ("q", "k", "v"))
    assert namespace["out"].shape == (1, 40, 4, 32)
    assert namespace["lse"].shape == (1, 4, 40)
    assert namespace["grads"].shape == (1, 40, 4, 32)
    out, lse = reference_attention(q, k, v, causal=True, sliding_window=(16, 0), return_lse=True)
    grads = jax.grad(lambda q: reference_attention(q, k, v, causal=True).sum())(q)
    close(namespace["out"], out, q.dtype, "out")
    close(namespace["lse"], lse, q.dtype, "lse")
    close(namespace["grads"], grads, q.dtype, "grad")
