"""The hero run: every stage of the pipeline as one Prefect flow.

    python -m flows.hero_run --config configs/smollm2-cpu.yaml [--set section.field=value ...]

Works without a Prefect server (Prefect starts a temporary one). Stages so far:
prepare-model -> serve -> smoke chat -> generate -> (server stopped) -> extract -> vocab -> train;
verify plugs in after train.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from eagle3.config import load_config
from tasks.extract import extract_task
from tasks.generate import generate_task
from tasks.prepare_model import prepare_model_task
from tasks.serve import smoke_chat_task, start_server_task, stop_server_task
from tasks.train import train_task
from tasks.vocab import vocab_task

SMOKE_PROMPT = "What is the capital of France? Answer in one sentence."


@flow(name="hero-run", log_prints=True)
def hero_run(config: str = "configs/smollm2-cpu.yaml", overrides: list[str] | None = None) -> dict[str, Any]:
    cfg = load_config(config, overrides or [])
    logger = get_run_logger()
    logger.info("hero run of profile %s (run dir %s)", cfg.name, cfg.paths.run_dir)
    model = prepare_model_task(cfg)
    server = start_server_task(cfg, model)
    try:
        answer = smoke_chat_task(server, SMOKE_PROMPT)
        gen = generate_task(cfg, [server.base_url, *cfg.generate.endpoints], str(cfg.paths.stage_dir("generate")),
                            tokenizer_path=model if cfg.target.is_embedded else cfg.target.tokenizer)
    finally:
        stop_server_task(server)
    ext = extract_task(cfg, str(cfg.paths.stage_dir("generate")), str(cfg.paths.stage_dir("extract")), model)
    voc = vocab_task(cfg, str(cfg.paths.stage_dir("extract")), str(cfg.paths.stage_dir("vocab")))
    trn = train_task(cfg, str(cfg.paths.stage_dir("extract")), str(cfg.paths.stage_dir("vocab") / "vocab.safetensors"),
                     model, str(cfg.paths.stage_dir("train")))
    summary = {
        "profile": cfg.name,
        "model": model,
        "server": server.info(),
        "smoke_chat": {"prompt": SMOKE_PROMPT, **answer.to_dict()},
        "generate": {"dir": str(cfg.paths.stage_dir("generate")), "totals": gen["totals"],
                     "this_run": gen["this_run"]},
        "extract": {"dir": str(cfg.paths.stage_dir("extract")), "samples": ext["samples"], "tokens": ext["tokens"],
                    "bytes_per_token": ext["bytes_per_token"], "aux_layers": ext["aux_layers"]},
        "vocab": {"dir": str(cfg.paths.stage_dir("vocab")), "coverage": voc["coverage"],
                  "draft_vocab_size": voc["draft_vocab_size"]},
        "train": {"dir": str(cfg.paths.stage_dir("train")), "export": trn["export"], "steps": trn["steps"],
                  "final_top1": (trn["final"] or {}).get("top1")},
    }
    cfg.paths.run_dir.mkdir(parents=True, exist_ok=True)
    out = cfg.paths.run_dir / "hero-run.json"
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(summary, indent=2))
    tmp.replace(out)
    create_markdown_artifact(
        key="hero-run-summary",
        markdown=(
            f"# Hero run: {cfg.name}\n\n- target: `{model}`\n- server ready in {server.ready_s:.1f} s\n"
            f"- smoke chat: {answer.content!r} ({len(answer.completion_token_ids)} tokens, "
            f"{answer.latency_s:.2f} s)\n"
            f"- generate: {gen['totals']['samples']} samples, {gen['totals']['completion_tokens']} completion tokens, "
            f"{gen['this_run']['completion_tokens_per_s']} tok/s this run; errors {gen['totals']['errors_by_kind']}\n"
            f"- extract: {ext['samples']} samples, {ext['tokens']} tokens, layers {ext['aux_layers']}, "
            f"{ext['bytes_per_token']} bytes/token\n"
            f"- vocab: {voc['draft_vocab_size']} draft ids cover {voc['coverage']:.2%} of loss tokens\n"
            f"- train: {trn['steps']} steps, final top-1 per TTT step {(trn['final'] or {}).get('top1')}; "
            f"draft at `{trn['export']}`\n"
        ),
    )
    return summary


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--config", "-c", default="configs/smollm2-cpu.yaml")
    ap.add_argument("--set", "-s", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    args = ap.parse_args(argv)
    summary = hero_run(config=args.config, overrides=args.overrides)
    chat = summary["smoke_chat"]
    print(f"\nHero run {summary['profile']} finished: server ready in {summary['server']['ready_s']} s")
    print(f"Q: {chat['prompt']}\nA: {chat['content']}  ({len(chat['completion_token_ids'])} tokens)")
    gen = summary["generate"]
    print(f"generate: {gen['totals']['samples']} samples in {gen['dir']} "
          f"({gen['this_run']['completion_tokens_per_s']} tok/s this run)")
    print(f"extract: {summary['extract']['samples']} samples, {summary['extract']['tokens']} tokens; "
          f"vocab: {summary['vocab']['draft_vocab_size']} ids cover {summary['vocab']['coverage']:.2%}")
    t = summary["train"]
    top1 = [round(x, 3) for x in (t["final_top1"] or []) if x is not None]
    print(f"train: {t['steps']} steps, final top-1 per TTT step {top1}; draft for vLLM at {t['export']}")


if __name__ == "__main__":
    main()
