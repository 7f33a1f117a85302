"""The README's Python examples run as written."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from ejk_sequtils import reference_attention

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_examples_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 2
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)
    assert namespace["out"].shape == (2, 128, 8, 64)
    assert namespace["grads"].shape == (2, 128, 8, 64)
    # The packed-documents example in the model's zigzag order matches the one-device call.
    ids = namespace["ids"]
    want = reference_attention(
        namespace["q"], namespace["k"], namespace["v"], causal=True, segment_ids=ids
    )
    np.testing.assert_allclose(namespace["out_docs"], want, rtol=2e-5, atol=2e-5)
