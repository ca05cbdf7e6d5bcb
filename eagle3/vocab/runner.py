"""The pipeline's vocab stage: count the loss tokens of extract's stored training data, build and
save the draft vocabulary mapping (:mod:`eagle3.vocab.mapping`), its coverage curve (JSON + PNG)
and a manifest."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from eagle3.atomic import write_bytes_atomic
from eagle3.vocab.mapping import build_vocab, count_tokens, coverage_curve, save_vocab


def plot_coverage(curve: list[tuple[int, float]], path: Path, chosen: int | None = None) -> None:
    """Plot a :func:`coverage_curve` to PNG (matplotlib Agg, no display, no pyplot state).

    ``chosen`` (optional) draws a vertical line at the configured ``draft_vocab_size``.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    points = sorted(curve)
    fig = Figure(figsize=(6, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.plot([s for s, _ in points], [c for _, c in points], marker="o")
    if chosen is not None:
        ax.axvline(chosen, color="tab:red", linestyle="--", label=f"draft_vocab_size={chosen}")
        ax.legend(loc="lower right")
    ax.set_xlabel("draft vocabulary size")
    ax.set_ylabel("coverage of loss tokens")
    ax.set_ylim(0, 1.02)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    write_bytes_atomic(Path(path), buf.getvalue())


def _check_read(extract_dir: Path, read: int) -> None:
    """Fewer samples than extract's manifest lists means a shard went missing: fail, do not count
    less."""
    import json

    from eagle3.errors import MissingSamples

    man = extract_dir / "manifest.json"
    listed = json.loads(man.read_text()).get("samples") if man.is_file() else None
    if listed is not None and read < int(listed):
        raise MissingSamples(
            f"{extract_dir}: manifest.json lists {listed} samples, its shards hold {read}: a shard "
            "is missing; rerun extract into that folder (it recomputes what is missing), then vocab"
        )


def vocab_stage(
    extract_dir: Path,
    out_dir: Path,
    target_vocab_size: int,
    draft_vocab_size: int,
    metadata: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The pipeline's vocab stage: count loss tokens of the stored training data, build and save
    the mapping (``vocab.safetensors``), a coverage curve (JSON + PNG) and a manifest."""
    from eagle3.atomic import write_json_atomic
    from eagle3.extract.storage import iter_token_masks

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    read = [0]

    def counted():
        for pair in iter_token_masks(extract_dir):
            read[0] += 1
            yield pair

    counts = count_tokens(counted(), target_vocab_size)
    _check_read(Path(extract_dir), read[0])
    m = build_vocab(counts, draft_vocab_size)
    save_vocab(m, out_dir / "vocab.safetensors", metadata)
    sizes = sorted(
        {
            s
            for s in (256, 512, 1024, 2048, 4096, 8192, 16384, 32000, 65536, draft_vocab_size)
            if s <= target_vocab_size
        }
    )
    curve = coverage_curve(counts, sizes)
    plot_coverage(curve, out_dir / "coverage.png", chosen=draft_vocab_size)
    manifest = {
        "stage": "vocab",
        "extract_dir": str(extract_dir),
        "draft_vocab_size": draft_vocab_size,
        "target_vocab_size": target_vocab_size,
        "loss_tokens": int(counts.sum()),
        "distinct": m.distinct,
        "padded": m.padded,
        "coverage": round(m.coverage, 6),
        "coverage_curve": [{"size": s, "coverage": round(c, 6)} for s, c in curve],
    }
    write_json_atomic(out_dir / "manifest.json", manifest)
    return manifest
