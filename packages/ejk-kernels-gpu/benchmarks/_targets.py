"""Issue 20's targets, read off `bench_features` rows: each a ratio of two contenders'
median times (and of their traced GPU spans, where ``--trace-calls`` gave them), its
bound, and whether the run met it.

A target compares ``ours`` with ``theirs`` (the fastest of them where several are named)
on a phase, ``fwd`` or ``fwdbwd``. ``speed`` targets read ``their time / our time``
(``>= bound``); ``time`` targets read ``our time / their time`` (``<= bound``). A
contender that was skipped, failed or not timed on that phase leaves the target unread:
its entry says which contender was missing, and ``met`` is None."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple


class Target(NamedTuple):
    row: str  # the bench_features row (`bench_features.ROWS`)
    name: str
    ours: Mapping[str, object]  # fields a result row must match
    theirs: Sequence[Mapping[str, object]]
    phases: tuple[str, ...]
    kind: str  # "speed": theirs / ours >= bound; "time": ours / theirs <= bound
    bound: float


_SEG = {"impl": "ejk", "as": "segment_ids"}
_EJK = {"impl": "ejk"}
_CUDNN = {"impl": "cudnn"}
_TOKAMAX = {"impl": "tokamax"}
_BOTH = ("fwd", "fwdbwd")

TARGETS = (
    Target("documents", "segment ids' speed / cu_seqlens'", _SEG,
           ({"impl": "ejk", "as": "cu_seqlens"},), _BOTH, "speed", 0.95),
    Target("documents", "packed time / the padded batch's", _SEG,
           ({"impl": "ejk", "as": "padded batch"},), _BOTH, "time", 1.15),
    Target("window", "speed / the best of cuDNN and tokamax", _EJK, (_CUDNN, _TOKAMAX),
           ("fwd",), "speed", 1.0),
    Target("window", "speed / cuDNN's", _EJK, (_CUDNN,), ("fwdbwd",), "speed", 1.0),
    Target("softcap", "soft cap's speed / no cap's (ejk)", {"impl": "ejk", "soft_cap": 50.0},
           ({"impl": "ejk", "soft_cap": None},), _BOTH, "speed", 0.9),
    Target("softcap", "speed / tokamax's", {"impl": "ejk", "soft_cap": 50.0}, (_TOKAMAX,),
           _BOTH, "speed", 1.0),
    Target("head256", "speed / cuDNN's", _EJK, (_CUDNN,), ("fwd",), "speed", 1.0),
    Target("head256", "speed / cuDNN's", _EJK, (_CUDNN,), ("fwdbwd",), "speed", 0.9),
    Target("head64", "speed / cuDNN's", _EJK, (_CUDNN,), ("fwd",), "speed", 1.0),
)  # fmt: skip


def _matches(result: Mapping, row: str, fields: Mapping[str, object]) -> bool:
    return result.get("row") == row and all(
        result.get(key, None) == value for key, value in fields.items()
    )


def _times(results: Sequence[Mapping], row: str, fields: Mapping, key: str) -> list[float]:
    return [r[key] for r in results if _matches(r, row, fields) and isinstance(r.get(key), float)]


def _ratio(ours: float, theirs: float, kind: str) -> float:
    return theirs / ours if kind == "speed" else ours / theirs


def evaluate(results: Sequence[Mapping]) -> list[dict]:
    """Each target of a row present in ``results`` (`bench_features.run`'s rows), per
    phase: ``ratio`` on the median times (``*_ms``), ``gpu_ratio`` on the traced spans
    (``*_gpu_ms``, None without them), ``met`` on ``ratio`` (None where a contender's
    time is missing, named in ``missing``)."""
    present = {r.get("row") for r in results}
    out = []
    for target in TARGETS:
        if target.row not in present:
            continue
        for phase in target.phases:
            entry = dict(row=target.row, target=target.name, phase=phase, kind=target.kind,
                         bound=target.bound, ratio=None, gpu_ratio=None, met=None)  # fmt: skip
            ratios = {}
            for label, key in (("ratio", f"{phase}_ms"), ("gpu_ratio", f"{phase}_gpu_ms")):
                ours = _times(results, target.row, target.ours, key)
                theirs = [t for f in target.theirs for t in _times(results, target.row, f, key)]
                if len(ours) == 1 and theirs:
                    ratios[label] = _ratio(ours[0], min(theirs), target.kind)
                elif label == "ratio":
                    entry["missing"] = "ours" if len(ours) != 1 else "theirs"
            entry.update(ratios)
            if entry["ratio"] is not None:
                bound = target.bound
                entry["met"] = (
                    entry["ratio"] >= bound if target.kind == "speed" else entry["ratio"] <= bound
                )
            out.append(entry)
    return out


def table(entries: Sequence[Mapping]) -> str:
    """``entries`` (`evaluate`) as printed lines."""
    lines = [f"\n{'row':<10}{'target':<40}{'phase':<8}{'ratio':>7}{'gpu':>7}  {'bound':<7}result"]
    for e in entries:
        ratio = "-" if e["ratio"] is None else f"{e['ratio']:.3f}"
        gpu = "-" if e["gpu_ratio"] is None else f"{e['gpu_ratio']:.3f}"
        sign = ">=" if e["kind"] == "speed" else "<="
        result = {True: "met", False: "missed", None: f"not read ({e.get('missing')} missing)"}
        lines.append(
            f"{e['row']:<10}{e['target']:<40}{e['phase']:<8}{ratio:>7}{gpu:>7}  "
            f"{sign}{e['bound']:<5}{result[e['met']]}"
        )
    return "\n".join(lines)
