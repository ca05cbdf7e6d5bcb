"""`eagle3 plan` prices the three state layouts (offline, online, hybrid) and picks one
(eagle3/plan_states.py, issue 38): fast, no servers, no GPU."""

import json
import os

import pytest

from eagle3.config import load_config
from eagle3.plan import STATES_KEY, build_plan, target_config_for_plan
from eagle3.plan_rates import GIB, Node
from eagle3.plan_states import (
    TOKEN_BYTES,
    auto_cache_bytes,
    layout_pick,
    price,
    state_bytes_per_token,
    states_plan,
)
from tests.conftest import CPU_PROFILE, KIMI_PROFILE

KIMI_TOKENS = 10000 * (8192 + 512)  # every sample at full length (max_seq_len 16384 is longer)


def _kimi(tmp_path, *overrides):
    return load_config(KIMI_PROFILE, [f"paths.runs_dir={tmp_path}", *overrides])


def _states(cfg):
    conf = target_config_for_plan(cfg, cfg.target.model)[0]
    return states_plan(cfg, conf, None)


def test_kimi_three_layouts_and_the_pick(tmp_path):
    """The hero profile's estimates (plan: section): 4.6 TB offline exceeds the assumed 3,500 GiB
    disk, so the plan picks hybrid with the cache the node holds, as the profile says (a profile
    set to offline is warned). vLLM target: online/hybrid epochs overlap target and train (max,
    not sum)."""
    cfg = _kimi(tmp_path)
    s = _states(cfg)
    lay = s["layouts"]
    assert list(lay) == ["offline", "online", "hybrid (auto)"]
    assert lay["offline"] == (
        "disk 4,648.4 GiB of states; target 74 min once (extract); train 100 min an epoch, 16.6 h; "
        "total 17.9 h"
    )
    assert lay["online"].startswith("disk 0.7 GiB (tokens); target 74 min in epoch 1")
    assert lay["online"].endswith(
        "train 100 min an epoch, 16.6 h; total 16.6 h (overlapped; 29.0 h if not)"
    )
    assert "78.8% of the states cached" in lay["hybrid (auto)"]
    assert "total 16.6 h (overlapped; 20.2 h if not)" in lay["hybrid (auto)"]
    assert s["pick"].startswith("hybrid: offline's 4,648.4 GiB exceed the node's 3,150.0 GiB")
    assert "warning" not in s and s["profile"].startswith("hybrid (extract.states online")
    w = _states(_kimi(tmp_path, "extract.states=offline"))["warning"]
    assert "the profile asks for offline" in w and "picks hybrid" in w
    assert "estimate: plan.target_tokens_per_s" in s["basis"]["target"]

    # the formulas, in numbers
    t, rt, rd, e = KIMI_TOKENS, 19500, 14532, 10
    off = price(cfg, "offline", t, rt, rd)
    assert off.disk == t * state_bytes_per_token(cfg) == t * 4 * 7168 * 2
    assert off.total_s == pytest.approx(t / rt + e * t / rd)
    on = price(cfg, "online", t, rt, rd, 0.0, Node(3500 * GIB, 1024 * GIB, ""))
    assert on.disk == t * TOKEN_BYTES and on.share == 0
    assert on.total_s == pytest.approx(e * max(t / rt, t / rd))
    assert on.serial_s == pytest.approx(e * (t / rt + t / rd))


def test_in_process_target_adds_target_and_train(tmp_path):
    """The hf target shares the training GPU: an online epoch is target + train, not the max."""
    cfg = _kimi(tmp_path, "extract.backend=hf")
    t, rt, rd = 1e6, 1e4, 2e4
    on = price(cfg, "online", t, rt, rd, 0.0, Node(1e12, 0, ""))
    assert on.total_s == pytest.approx(10 * (t / rt + t / rd)) == on.serial_s
    assert "if not" not in _states(cfg)["layouts"]["online"]


def test_offline_is_picked_where_its_disk_fits(tmp_path):
    """A node with 10,000 GiB holds the 4,648 GiB store: offline, no warning for an offline
    profile; a profile that asks for online is told the plan picks offline."""
    s = _states(_kimi(tmp_path, "plan.node_disk_gib=10000", "extract.states=offline"))
    assert s["pick"].startswith("offline: its 4,648.4 GiB of states fit the node's 9,000.0 GiB")
    assert "warning" not in s
    small = [
        f"paths.runs_dir={tmp_path}",
        "plan.node_disk_gib=100",
        "plan.host_memory_gib=16",
        "plan.target_tokens_per_s=1000",
        "plan.train_tokens_per_s=500",
    ]
    s = _states(load_config(CPU_PROFILE, [*small, "extract.states=online"]))
    assert s["pick"].startswith("offline:")
    assert s["warning"].startswith("the profile asks for hybrid (extract.states online")


def test_online_only_when_no_cache_fits(tmp_path):
    """6 GiB of disk less the 5 GiB margin holds the 0.7 GiB of tokens and 0.3 GiB of cache, under
    1% of the states: online. 5 GiB holds not even the tokens: online, and say so."""
    s = _states(_kimi(tmp_path, "plan.node_disk_gib=6", "plan.host_memory_gib=0.001"))
    assert s["pick"].startswith("online: neither offline's 4,648.4 GiB nor a cache of 1%")
    s = _states(_kimi(tmp_path, "plan.node_disk_gib=5", "plan.host_memory_gib=0.001"))
    assert s["pick"].startswith("online: not even the token ids (0.7 GiB) fit")


def test_hybrid_share_for_a_numeric_budget(tmp_path):
    """train.state_cache_gib 1000 of the 4,648.4 GiB of states: 21.5% cached; half the host memory
    (512 GiB) holds the first part, the disk the rest; later epochs recompute 78.5%."""
    cfg = _kimi(tmp_path, "extract.states=online", "train.state_cache_gib=1000")
    s = _states(cfg)
    line = s["layouts"]["hybrid (train.state_cache_gib 1000)"]
    assert "21.5% of the states cached" in line
    assert "tokens + 488.0 GiB of cache; 512.0 GiB more in host memory" in line
    node = Node(3500 * GIB, 1024 * GIB, "")
    h = price(cfg, "hybrid", KIMI_TOKENS, 19500, 14532, 1000 * GIB, node)
    states = KIMI_TOKENS * state_bytes_per_token(cfg)
    assert h.share == pytest.approx(1000 * GIB / states)
    assert h.disk == pytest.approx(KIMI_TOKENS * TOKEN_BYTES + 488 * GIB)
    first, later = h.target_epoch_s
    assert later == pytest.approx((1 - h.share) * KIMI_TOKENS / 19500) and first > later
    # the pick is hybrid too (no warning), with a word on the larger cache auto would keep
    assert s["pick"].startswith("hybrid") and "warning" not in s
    assert s["note"] == (
        "the profile's cache keeps 21.5% of the states; auto would keep 78.8% on this node"
    )


def test_auto_everywhere(tmp_path):
    """train.state_cache_gib auto (the default): the cache the node holds (half the host memory +
    the disk left after the tokens and the margin, at most every state); preflight counts the
    tokens only, since auto never takes more than the free disk less the margin."""
    from eagle3.preflight import _disk, extract_bytes_upper_bound

    cfg = _kimi(tmp_path, "extract.states=online")
    assert cfg.train.state_cache_gib == "auto"
    node = Node(3500 * GIB, 1024 * GIB, "")
    room = 3500 * GIB - 350 * GIB
    assert auto_cache_bytes(cfg, node, KIMI_TOKENS) == pytest.approx(
        512 * GIB + room - KIMI_TOKENS * TOKEN_BYTES
    )
    big = Node(1e15, 1e13, "")
    assert auto_cache_bytes(cfg, big, KIMI_TOKENS) == KIMI_TOKENS * state_bytes_per_token(cfg)
    assert extract_bytes_upper_bound(cfg) == KIMI_TOKENS * TOKEN_BYTES
    numeric = _kimi(tmp_path, "extract.states=online", "train.state_cache_gib=2")
    assert extract_bytes_upper_bound(numeric) == KIMI_TOKENS * TOKEN_BYTES + 2 * GIB
    assert "states hybrid: tokens + a cache of what the disk has free" in _disk(cfg).detail
    assert _states(cfg)["profile"] == "hybrid (extract.states online, train.state_cache_gib auto)"
    assert layout_pick(cfg, node) == "hybrid"
    assert layout_pick(cfg, Node(1e14, 0, "")) == "offline"


def _fake_run(runs, name, extract: dict, train: dict | None):
    """A run folder as extract and train leave it: <stage>/<key>/manifest.json and latest."""
    out = {}
    for stage, m in (("extract", extract), ("train", train)):
        if m is None:
            continue
        folder = runs / name / stage / "k1"
        folder.mkdir(parents=True)
        if stage == "train":
            m = {**m, "extract_dir": str(out["extract"])}
        (folder / "manifest.json").write_text(json.dumps(m))
        os.symlink("k1", runs / name / stage / "latest")
        out[stage] = folder
    return out


def test_measured_rates_win_over_the_estimates(tmp_path):
    """A previous offline run of the profile: its extract's tokens/s and token count, and its
    train loop's tokens x epochs / loop_s, are what the plan prices with ("measured")."""
    extract = {
        "states": "offline",
        "backend": "vllm",
        "tokens": 2_000_000,
        "samples": 500,
        "this_run": {"stored": 500, "tokens_per_s": 40000.0},
    }
    train = {
        "complete": True,
        "resumed_from_step": None,
        "states": {"mode": "offline"},
        "loop_s": 400.0,
        "train_config": {"epochs": 2},
    }
    _fake_run(tmp_path, "kimi-k25-hero", extract, train)
    s = _states(_kimi(tmp_path, "extract.states=offline"))
    b = s["basis"]
    assert b["target"].startswith("40,000 tokens/s (measured: ")
    assert b["train"].startswith("10,000 tokens/s (measured: ")  # 2 M x 2 epochs / 400 s
    assert b["tokens an epoch"].startswith("2,000,000, measured: 500 samples")
    # offline: 2 M / 40,000 (50 s) + 10 epochs x 2 M / 10,000 (2,000 s) = 2,050 s = 34 min
    assert s["layouts"]["offline"].endswith(
        "target 50 s once (extract); train 3 min an epoch, 33 min; total 34 min"
    )
    # small enough for the assumed node: offline, as the profile says
    assert s["pick"].startswith("offline") and "warning" not in s


def test_online_or_resumed_runs_are_not_measurements(tmp_path):
    """A token-only extract ran no target, a resumed train loop covers part of its epochs: the
    plan keeps the profile's estimates."""
    extract = {"states": "online", "backend": "vllm", "tokens": 2_000_000, "samples": 500,
               "this_run": {"stored": 500, "tokens_per_s": 900000.0}}  # fmt: skip
    train = {"complete": True, "resumed_from_step": 10, "states": {"mode": "offline"},
             "loop_s": 400.0, "train_config": {"epochs": 2}}  # fmt: skip
    _fake_run(tmp_path, "kimi-k25-hero", extract, train)
    b = _states(_kimi(tmp_path))["basis"]
    assert b["target"] == "19,500 tokens/s (estimate: plan.target_tokens_per_s)"
    assert b["train"] == "14,532 tokens/s (estimate: plan.train_tokens_per_s)"


def test_the_plan_carries_the_layouts(tmp_path):
    plan = build_plan(_kimi(tmp_path))
    s = plan["stages"]["extract"][STATES_KEY]
    assert s["pick"].startswith("hybrid") and len(s["layouts"]) == 3
