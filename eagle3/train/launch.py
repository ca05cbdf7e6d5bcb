"""Run the train stage on several local processes (torchrun) from a single-process caller.

The train stage (``eagle3.stages``, for the CLI and the Prefect task alike) calls
:func:`torchrun_train` when ``train.nproc_per_node`` > 1 and it is not already a torchrun rank; it
has released the GPUs first. This writes the resolved profile next to the output, starts
``torchrun --standalone --nproc-per-node N -m eagle3.train.launch ...`` (one rank per GPU; gloo
on CPU), streams the ranks' output to ``out_dir/torchrun.log`` and returns the manifest rank 0
wrote.
A retry is a resume: the ranks load ``out_dir/checkpoints/latest`` as a single process would.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from eagle3.atomic import write_json_atomic


class LaunchFailed(RuntimeError):
    """torchrun exited non-zero; the message carries the end of its log."""


def torchrun_train(
    cfg: Any,
    extract_dir: Path,
    vocab_path: Path,
    target_dir: Path,
    out_dir: Path,
    nproc: int,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg_path = out_dir / "launch-config.json"
    write_json_atomic(cfg_path, cfg.model_dump(mode="json"))
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "eagle3.train.launch",
        str(cfg_path),
        str(extract_dir),
        str(vocab_path),
        str(target_dir),
        str(out_dir),
    ]
    log_path = out_dir / "torchrun.log"
    log(f"train: {' '.join(argv[2:6])} ... (log {log_path})")
    with open(log_path, "ab") as f:
        rc = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        tail = log_path.read_text(errors="replace").splitlines()[-30:]
        raise LaunchFailed(
            f"torchrun ({nproc} ranks) exited {rc}; last lines of {log_path}:\n" + "\n".join(tail)
        )
    m = json.loads((out_dir / "manifest.json").read_text())
    if not m.get("complete"):
        raise LaunchFailed(
            f"{out_dir}: torchrun finished but the manifest says the run is incomplete"
        )
    return m


def main(argv: list[str] | None = None) -> None:
    """One rank (under torchrun): the library's train() with the launcher's resolved profile."""
    from eagle3.config import config_from_dict
    from eagle3.train import train

    cfg_path, extract_dir, vocab_path, target_dir, out_dir = (argv or sys.argv[1:])[:5]
    cfg = config_from_dict(json.loads(Path(cfg_path).read_text()), source=cfg_path)

    def progress(p: dict[str, Any]) -> None:
        if p["step"] % 10 == 0 or p["step"] == p["total_steps"]:
            print(f"step {p['step']}/{p['total_steps']} loss {p['loss']}", flush=True)

    train(
        cfg,
        Path(extract_dir),
        Path(vocab_path),
        Path(target_dir),
        Path(out_dir),
        on_progress=progress,
    )


if __name__ == "__main__":
    main()
