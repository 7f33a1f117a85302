"""The README's Python examples run as written."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

import ejk_attention
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


ROOT = Path(__file__).resolve().parents[3]
# What the xla backend is, in one place (`_xla.XLA_BACKEND`); the docs say the same.
DOCS = [
    ROOT / "README.md",
    README,
    ROOT / "docs" / "porting-from-ejkernel.md",
    *sorted(ROOT.glob("packages/*/README.md")),
]
# Earlier descriptions that called the xla backend the float32 reference itself.
WRONG = ("XLA reference", "the float32 reference itself", "reference_attention (dense")


def test_one_description_of_the_xla_backend_everywhere(capsys, monkeypatch):
    from ejk_attention import _xla
    from ejk_attention.cli import main

    monkeypatch.setenv("COLUMNS", "400")
    assert main(["info", "--json"]) == 0
    out = capsys.readouterr().out
    assert json.loads(out[out.index("{") :])["backends"]["xla"] == _xla.XLA_BACKEND
    for doc in DOCS:
        text = " ".join(doc.read_text().split())
        for phrase in WRONG:
            assert phrase not in text, f"{doc.relative_to(ROOT)} says {phrase!r}"
    for doc in (ROOT / "README.md", README, ROOT / "docs" / "porting-from-ejkernel.md"):
        assert "`_xla.xla_attention`" in doc.read_text(), doc.relative_to(ROOT)
    assert "XLA reference" not in (ejk_attention.__doc__ or "")
