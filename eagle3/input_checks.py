"""Every input of a stage checked before its first server starts or its first model loads.

Why (issue #39): an empty dataset started vLLM (46 s) before failing; a target named by a hub id
on a machine without network retried for 50 s; train took a vocab file built for another
extract, of another size, without a word; a random file as ``--vocab-file`` or a draft folder
that is not one ended in a traceback. Each check here raises one of ``eagle3.errors``' types with
one line that says what to do, and runs in seconds: ``eagle3.stages.run_stage`` calls
:func:`check_stage_inputs` first, the CLI calls :func:`check_target_available` before it starts a
server, and generate's command :func:`check_dataset`.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from eagle3.config import PipelineConfig
from eagle3.errors import Eagle3Error, InputDataError


class TargetUnavailable(Eagle3Error, FileNotFoundError):
    """The target's checkpoint is neither a local folder nor reachable: says which file is
    missing where, and what to do."""


_hub_reachable: dict[str, str | None] = {}


def hub_unreachable_reason(timeout_s: float = 3.0) -> str | None:
    """Why the model hub cannot be reached (None: it can). HF_HUB_OFFLINE=1 counts as
    unreachable; otherwise one TCP connect to the hub's host, remembered for the process."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return "HF_HUB_OFFLINE is set"
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    if endpoint not in _hub_reachable:
        u = urlparse(endpoint)
        port = u.port or (443 if u.scheme == "https" else 80)
        try:
            socket.create_connection((u.hostname or "", port), timeout=timeout_s).close()
            _hub_reachable[endpoint] = None
        except OSError as e:
            _hub_reachable[endpoint] = f"{u.hostname}:{port} cannot be reached ({e})"
    return _hub_reachable[endpoint]


def looks_like_hub_id(name: str) -> bool:
    """``owner/name``: one slash, not a path (no leading /, ., ~)."""
    return name.count("/") == 1 and not name.startswith(("/", ".", "~")) and " " not in name


def check_dataset(cfg: PipelineConfig) -> None:
    """Open the dataset and read up to its first prompt. Called before any server starts, so a
    missing, unreadable or empty file fails in a second instead of after the server's load
    (issues #30, #39: an empty file started vLLM, 46 s, and the error pointed at an empty errors
    file)."""
    from eagle3.generate.prompts import Prompt, PromptStats, Skip
    from eagle3.generate.runner import load_prompts

    stats = PromptStats()
    skips: list[Skip] = []
    for item in load_prompts(cfg, stats):
        if isinstance(item, Prompt):
            return
        skips.append(item)
    g = cfg.generate
    if not stats.rows:
        raise InputDataError(
            f"dataset {g.dataset} holds no rows (an empty file?): give generate.dataset a "
            "file with prompts (.jsonl: one JSON object per line)"
        )
    first = f"; first: {skips[0].source_index}: {skips[0].reason}" if skips else ""
    raise InputDataError(
        f"dataset {g.dataset}: none of its {stats.rows} rows is a usable prompt ({stats.skipped} "
        f"unreadable, {stats.duplicates} duplicates, {stats.excluded} excluded{first}): fix the "
        "rows (formats: sharegpt conversations, messages, or a prompt column: "
        "generate.data_format, generate.prompt_column)"
    )


def check_target_available(cfg: PipelineConfig, for_server: bool = False) -> None:
    """A target that is not embedded must be a local folder with a config.json, or a hub id that
    is in the local Hugging Face cache or can be downloaded. Fails at once otherwise: vLLM
    retried for 50 s and the command then exited 0. ``for_server``: only a server will read it;
    a systemd unit's or an external server has its own cache and network: not checked here."""
    model = cfg.target.model
    if cfg.target.is_embedded or (for_server and cfg.serve.backend != "process"):
        return
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise TargetUnavailable(
                f"target.model {model}: the folder has no config.json: point target.model at the "
                "checkpoint folder (config.json, tokenizer, *.safetensors)"
            )
        return
    if not looks_like_hub_id(model):
        raise TargetUnavailable(
            f"target.model {model}: no such folder (and not a hub id owner/name): set "
            "target.model to the checkpoint's folder"
        )
    from huggingface_hub import constants, try_to_load_from_cache

    cached = try_to_load_from_cache(model, "config.json")
    if isinstance(cached, str):
        return
    why = hub_unreachable_reason()
    if why is None:
        return  # vLLM downloads it on its first start
    raise TargetUnavailable(
        f"target.model {model}: config.json is not in the local Hugging Face cache "
        f"({constants.HF_HUB_CACHE}) and the hub cannot be reached ({why}): download it where "
        f"there is network (`huggingface-cli download {model}`, same HF_HOME) or set "
        "target.model to a local checkpoint folder"
    )


def check_vocab_file(cfg: PipelineConfig, vocab_path: Path, extract_dir: Path | None) -> None:
    """The vocab file train reads: a vocab file at all, of the profile's sizes, built from the
    extract it trains on (when both say which: ``extract_tokens_key`` in the vocab file's
    metadata, ``tokens_key`` in the extract's artifact.json)."""
    from eagle3.vocab import load_vocab

    vocab_path = Path(vocab_path)
    redo = "rerun `eagle3 vocab` on this extract, or pass its vocab.safetensors with --vocab-file"
    if not vocab_path.is_file():
        raise InputDataError(f"vocab file {vocab_path} not found: {redo}")
    try:
        m = load_vocab(vocab_path)
    except Exception as e:  # noqa: BLE001 - safetensors raises its own types for a random file
        first = (str(e).splitlines() or [type(e).__name__])[0][:160]
        raise InputDataError(
            f"{vocab_path} is not a vocab file written by `eagle3 vocab` ({type(e).__name__}: "
            f"{first}): {redo}"
        ) from None
    want = cfg.vocab.draft_vocab_size
    if m.draft_vocab_size != want:
        raise InputDataError(
            f"{vocab_path} has {m.draft_vocab_size} draft rows, the profile's "
            f"vocab.draft_vocab_size is {want}: {redo}, or set vocab.draft_vocab_size="
            f"{m.draft_vocab_size}"
        )
    if m.target_vocab_size != cfg.target.vocab_size:
        raise InputDataError(
            f"{vocab_path} maps a target vocabulary of {m.target_vocab_size} ids, the profile's "
            f"target.vocab_size is {cfg.target.vocab_size} (another tokenizer): {redo}"
        )
    built_from = m.metadata.get("extract_tokens_key")
    if extract_dir is None or not built_from:
        return
    from eagle3.artifacts import read_marker

    tokens_key = ((read_marker(Path(extract_dir)) or {}).get("result") or {}).get("tokens_key")
    if tokens_key and tokens_key != built_from:
        raise InputDataError(
            f"{vocab_path} was built from another extract (tokens {built_from}) than "
            f"{extract_dir} (tokens {tokens_key}): {redo}"
        )


def check_draft_dir(draft_dir: Path) -> None:
    """An exported draft folder vLLM can load: config.json that parses, and safetensors weights
    whose headers read."""
    from safetensors import safe_open

    draft_dir = Path(draft_dir)
    train = "run the train stage, or pass the vllm-draft folder of a train folder with --draft"
    if not draft_dir.is_dir():
        raise InputDataError(f"draft {draft_dir}: no such folder: {train}")
    cfg_file = draft_dir / "config.json"
    try:
        conf: Any = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        raise InputDataError(
            f"draft {draft_dir}: config.json missing or unreadable ({type(e).__name__}): {train}"
        ) from None
    if not isinstance(conf, dict) or not (
        conf.get("architectures") or conf.get("speculators_model_type")
    ):
        raise InputDataError(
            f"draft {draft_dir}: config.json names no architecture (not an exported draft): {train}"
        )
    weights = sorted(draft_dir.glob("*.safetensors"))
    if not weights:
        raise InputDataError(f"draft {draft_dir}: no *.safetensors weights: {train}")
    for w in weights:
        try:
            with safe_open(str(w), framework="pt") as f:
                f.keys()
        except Exception as e:  # noqa: BLE001 - safetensors' own error types
            raise InputDataError(
                f"draft {draft_dir}: {w.name} is not a readable safetensors file "
                f"({type(e).__name__}): {train}"
            ) from None


#: what an input stage's folder must hold for the next stage to read it, and the option that
#: names the folder on the command line
INPUT_FOLDERS = {
    "generate": ("manifest.json", "--generate-dir"),
    "extract": ("index.json", "--extract-dir"),
}


def check_input_folder(stage: str, inp: str, folder: Path) -> None:
    """An input stage's folder exists and was written by that stage. Before: a missing generate
    folder ended in ``[Errno 2] ... manifest.json`` and a missing extract folder in "no
    loss-carrying tokens were counted"."""
    if inp not in INPUT_FOLDERS:
        return
    name, option = INPUT_FOLDERS[inp]
    folder = Path(folder)
    if not folder.is_dir():
        raise InputDataError(
            f"{stage}: its {inp} folder {folder} does not exist: run `eagle3 {inp}` first, or "
            f"name the folder with {option}"
        )
    if not (folder / name).is_file() and folder.name == inp:  # a stage root: no `latest` yet
        raise InputDataError(
            f"{stage}: no finished {inp} run in {folder} (no `latest`): run `eagle3 {inp}` "
            f"first (it resumes an unfinished run), or name a folder with {option}"
        )
    if not (folder / name).is_file():
        raise InputDataError(
            f"{stage}: {folder} has no {name}: {inp} did not finish there (rerun `eagle3 {inp}` "
            f"into it: it resumes), or name another folder with {option}"
        )


def check_stage_inputs(stage: str, run: Any) -> None:
    """The checks of ``stage`` on its :class:`eagle3.stages.StageRun`, before it runs."""
    cfg = run.cfg
    if stage in ("extract", "train", "verify"):
        check_target_available(cfg)
    for inp, folder in run.inputs.items():
        check_input_folder(stage, inp, folder)
    if stage == "train":
        from eagle3.stages import STAGES

        vocab = run.options.get("vocab_file") or STAGES["vocab"].file(run.inputs["vocab"], "vocab")
        check_vocab_file(cfg, Path(vocab), run.inputs.get("extract"))
    if stage == "verify":
        from eagle3.stages import STAGES

        draft = run.options.get("draft_dir") or STAGES["train"].file(run.inputs["train"], "draft")
        check_draft_dir(Path(draft))
