"""Generate stage parts that need no model: prompt loading, storage, retries, the knee."""

import asyncio
import json

import pytest

from eagle3.generate.client import Exhausted, Rejected, RetryPolicy, chat_request, make_pool
from eagle3.generate.profile import pick_knee
from eagle3.generate.prompts import (
    Prompt,
    PromptStats,
    Skip,
    exclusion_keys,
    iter_prompts,
    sample_id,
)
from eagle3.generate.storage import ShardStore, iter_samples, repair_jsonl
from eagle3.serving.readiness import free_port


def write_lines(path, lines):
    with open(path, "wb") as f:
        for ln in lines:
            f.write((ln if isinstance(ln, bytes) else json.dumps(ln).encode()) + b"\n")
    return path


def test_formats_ids_and_turns(tmp_path):
    conv = [
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "Hi"},
        {"from": "gpt", "value": "Hello"},
        {"from": "human", "value": "Bye?"},
        {"from": "gpt", "value": "Bye"},
    ]
    p = write_lines(
        tmp_path / "d.jsonl",
        [
            {"conversations": conv},
            {
                "messages": [
                    {"role": "user", "content": "Q1"},
                    {"role": "assistant", "content": "A1"},
                ]
            },
            {"prompt": "Plain"},
        ],
    )
    first = [x for x in iter_prompts(str(p), turns="first") if isinstance(x, Prompt)]
    history = {x.messages[-1]["content"]: x for x in iter_prompts(str(p), turns="history")}
    assert sorted(m.messages[-1]["content"] for m in first) == ["Hi", "Plain", "Q1"]
    sys_first = next(m for m in first if m.messages[-1]["content"] == "Hi")
    assert sys_first.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]
    assert [m["content"] for m in history["Bye?"].messages] == ["Be brief.", "Hi", "Hello", "Bye?"]
    assert sys_first.id == sample_id(sys_first.messages) and len(sys_first.id) == 24


def test_bad_rows_are_skipped_with_reasons(tmp_path):
    p = write_lines(
        tmp_path / "bad.jsonl",
        [
            {"prompt": "good one"},
            b'{"prompt": "broken',
            b'{"prompt": "caf\xe9 latin-1"}',
            {"prompt": "   "},
            {"messages": [{"role": "wizard", "content": "x"}]},
            {"other": 1},
            {"prompt": "good one"},  # duplicate
        ],
    )
    stats = PromptStats()
    items = list(iter_prompts(str(p), stats=stats))
    prompts = [x for x in items if isinstance(x, Prompt)]
    reasons = {x.source_index: x.reason for x in items if isinstance(x, Skip)}
    assert [x.messages[0]["content"] for x in prompts] == ["good one"]
    assert reasons["line 2"].startswith("malformed JSON")
    assert reasons["line 3"] == "invalid UTF-8 at byte 15"
    assert reasons["line 4"] == "empty prompt"
    assert "unknown role 'wizard'" in reasons["line 5"]
    assert "no conversations/messages/prompt column" in reasons["line 6"]
    assert stats.duplicates == 1 and stats.skipped == 5


def test_num_samples_seed_and_exclusion(tmp_path):
    p = write_lines(tmp_path / "d.jsonl", [{"prompt": f"question {i}"} for i in range(50)])
    a = [x.id for x in iter_prompts(str(p), num_samples=10, seed=1)]
    assert a == [x.id for x in iter_prompts(str(p), num_samples=10, seed=1)] and len(a) == 10
    assert a != [x.id for x in iter_prompts(str(p), num_samples=10, seed=2)]
    mt = write_lines(
        tmp_path / "mt_bench.jsonl", [{"question_id": 81, "turns": ["Question  3", "follow-up"]}]
    )
    kept = [x.messages[0]["content"] for x in iter_prompts(str(p), exclude=exclusion_keys([mt]))]
    assert "question 3" not in kept and len(kept) == 49


def test_iteration_is_lazy(tmp_path):
    p = write_lines(tmp_path / "d.jsonl", [{"prompt": f"q{i}"} for i in range(1000)])
    it = iter_prompts(str(p))
    assert isinstance(next(it), Prompt)  # a generator: nothing parsed beyond what was asked for


def rec(sid: str, x) -> dict:
    """A minimal sample record (readers skip a record without its id lists: issue #30)."""
    return {"id": sid, "x": x, "prompt_token_ids": [1], "completion_token_ids": [2]}


def test_shards_rotate_and_torn_tail_is_dropped(tmp_path):
    store = ShardStore(tmp_path, shard_size=3)
    for i in range(7):
        store.add(rec(f"s{i}", i))
    store.add(rec("s0", "dup"))  # never twice
    store.close()
    assert sorted(p.name for p in tmp_path.glob("samples-*")) == [
        "samples-00000.jsonl",
        "samples-00001.jsonl",
        "samples-00002.jsonl.open",
    ]
    with open(tmp_path / "samples-00002.jsonl.open", "ab") as f:
        f.write(b'{"id": "s7", "x": ')  # a kill in the middle of a write
    store = ShardStore(tmp_path, shard_size=3)
    assert store.torn_bytes == len(b'{"id": "s7", "x": ') and store.done_ids == {
        f"s{i}" for i in range(7)
    }
    store.add(rec("s7", 7))
    store.finalize()
    ids = [r["id"] for r in iter_samples(tmp_path)]
    assert ids == [f"s{i}" for i in range(8)]
    assert not list(tmp_path.glob("*.open"))


def test_repair_keeps_complete_records(tmp_path):
    p = tmp_path / "e.jsonl"
    p.write_bytes(b'{"a": 1}\n{"a": 2}\n{"a"')
    records, dropped = repair_jsonl(p)
    assert (
        records == [{"a": 1}, {"a": 2}]
        and dropped == 4
        and p.read_bytes() == b'{"a": 1}\n{"a": 2}\n'
    )


def _send(url, policy):
    async def go():
        pool = make_pool([url], api_key=None, timeout_s=5, connect_timeout_s=2, max_connections=2)
        try:
            return await chat_request(
                pool,
                {"model": "zero", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
                policy,
            )
        finally:
            await pool.close()

    return asyncio.run(go())


def test_retries_429_and_5xx_then_succeeds(scripted):
    url = scripted("429,503,500")
    resp, endpoint, attempts, _ = _send(url, RetryPolicy(max_attempts=5, base_s=0.01, max_s=0.05))
    assert attempts == 4 and resp["choices"][0]["token_ids"] == [1, 2, 3, 4] and endpoint == url


def test_400_is_not_retried(scripted):
    url = scripted("400")
    with pytest.raises(Rejected, match=r"rejected by server \(400\): scripted 400"):
        _send(url, RetryPolicy(max_attempts=5, base_s=0.01))


def test_gives_up_after_max_attempts(scripted):
    url = scripted("503,503,503,503")
    with pytest.raises(Exhausted, match="after 3 attempts"):
        _send(url, RetryPolicy(max_attempts=3, base_s=0.01))
    with pytest.raises(Exhausted, match="Cannot connect to host 127.0.0.1"):
        _send(f"http://127.0.0.1:{free_port()}", RetryPolicy(max_attempts=2, base_s=0.01))


def test_backoff_has_full_jitter_and_a_cap():
    p = RetryPolicy(base_s=1, max_s=8)
    delays = [p.delay(10) for _ in range(200)]
    assert max(delays) <= 8 and min(delays) < 2 and len(set(delays)) > 100


def test_knee_is_smallest_level_near_best():
    levels = [
        {"concurrency": c, "tokens_per_s": t}
        for c, t in [(1, 30), (16, 200), (64, 285), (128, 290), (200, 289)]
    ]
    assert pick_knee(levels, 0.97) == 64
    assert pick_knee(levels, 1.0) == 128


def test_history_turns_keep_an_unanswered_question():
    from eagle3.generate.prompts import select_turns

    answered = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d"},
    ]
    assert [m["content"] for m in select_turns(answered, "history")] == ["a", "b", "c"]
    assert [m["content"] for m in select_turns(answered[:3], "history")] == ["a", "b", "c"]
    assert [m["content"] for m in select_turns(answered, "first")] == ["a"]


def test_rebuild_wraps_reasoning_in_think_tokens(think_model):
    """Rebuilt ids equal the chat template's own rendering of the whole turn."""
    from transformers import AutoTokenizer

    from eagle3.tokens import rebuild_token_ids

    tok = AutoTokenizer.from_pretrained(think_model)
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    prompt, completion = rebuild_token_ids(
        tok, msgs, "2 plus 2 is 4.", "The answer is 4.", "stop", think_start_id=15, think_end_id=16
    )
    whole = (
        tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        + "2 plus 2 is 4.</think>The answer is 4.<|im_end|>"
    )
    assert prompt + completion == tok(whole, add_special_tokens=False)["input_ids"]
    assert completion.count(16) == 1 and 15 not in completion  # <think> was opened by the prompt
    _, cut = rebuild_token_ids(
        tok, msgs, "still thinking", None, "length", think_start_id=15, think_end_id=16
    )
    assert 16 not in cut and cut[-1] != tok.eos_token_id  # never closed, cut at max_tokens
    with pytest.raises(ValueError, match="no think tokens"):
        rebuild_token_ids(tok, msgs, "r", "c", "stop")


def test_parquet_and_json_sources(tmp_path):
    import datasets

    rows = [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]}
        for i in range(5)
    ]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "d.parquet"))
    (tmp_path / "d.json").write_text(json.dumps(rows))
    for name in ("d.parquet", "d.json"):
        got = sorted(x.messages[0]["content"] for x in iter_prompts(str(tmp_path / name)))
        assert got == [f"q{i}" for i in range(5)], name
    with pytest.raises(FileNotFoundError):
        list(iter_prompts(str(tmp_path / "missing.jsonl")))
