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
    # The flex example: its documents mask as segment ids, causal.
    q, k, v, doc_ids = (namespace[name] for name in ("q", "k", "v", "doc_ids"))
    want = reference_attention(q, k, v, causal=True, segment_ids=doc_ids)
    np.testing.assert_allclose(namespace["flex_out"], want, rtol=2e-5, atol=2e-5)
    assert namespace["skipped"] == 0.75
    assert namespace["flex_dbias"].shape == (8, 255)
