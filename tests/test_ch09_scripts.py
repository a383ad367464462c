"""Chapter 09's scripts beyond what the notebook runs: bad input for each (one line and exit
status 2, in this process: argparse stops them before any process group), ring attention at
N = 3 (the notebook runs N = 2), and the simulation at a small point.

The notebook (nbval) runs every script at its defaults and asserts their results: ring and
Ulysses parity and bytes, torch's context_parallel() on the CPU, FSDP2 x CP with masked labels
(the global-token loss equal to one process, the mean of the ranks' means not), the MoE anatomy,
EP by hand and inside FSDP2 on 2 ranks (the experts' divide factor right, FSDP's default 2x),
transformers' EP, the simulation against the planner. make test-nproc adds the 4-rank cases.
torch_cp.py's GPU path is `make gpu-smoke`'s ("ch09 context_parallel()")."""
import json

import pytest

from conftest import run_in_process, run_json, run_papermill, run_scripts_at_once

CH = "ch09_long_context_moe"


@pytest.mark.parametrize("script, args, env, message", [
    ("ring_attention.py", ["--seq", "30"], {"WORLD_SIZE": "2"},
     "--seq 30 must be a multiple of 2 x 2 processes"),
    ("ring_attention.py", ["--layouts", "zigzag"], {}, "--layouts: unknown zigzag"),
    ("ulysses.py", ["--kv-heads", "3", "--heads", "6"], {"WORLD_SIZE": "2"},
     "--seq, --heads and --kv-heads must be multiples of 2 processes"),
    ("torch_cp.py", ["--seq", "6"], {"WORLD_SIZE": "2"},
     "--seq 6 must be a multiple of 2 x 2 processes"),
    ("fsdp_cp.py", ["--cp", "3"], {"WORLD_SIZE": "4"}, "--cp 3 must divide the 4 processes"),
    ("fsdp_cp.py", ["--methods", "ring,flash"], {"WORLD_SIZE": "4"}, "--methods: unknown flash"),
    ("fsdp_cp.py", ["--losses", "global,sum"], {"WORLD_SIZE": "4"}, "--losses: unknown sum"),
    ("fsdp_cp.py", ["--prompt", "26"], {"WORLD_SIZE": "4"}, "each sequence needs a valid label"),
    ("moe_ep.py", ["--experts", "3"], {"WORLD_SIZE": "2"},
     "--experts a multiple of 2 processes"),
    ("moe_ep.py", ["--ep", "3"], {"WORLD_SIZE": "4"}, "--ep 3 must be >= 2 and divide the 4"),
    ("hf_ep.py", ["--experts", "3"], {"WORLD_SIZE": "2"},
     "--experts >= 2 a multiple of 2 processes"),
    ("moe_anatomy.py", ["--top-k", "5"], {}, "--top-k <= --experts"),
    ("simulate_cp_ep.py", ["--cp", "16"], {}, "--cp must divide"),
    ("simulate_cp_ep.py", ["--ep", "3"], {}, "each --ep must divide"),
])
def test_bad_input_one_line_error(monkeypatch, capsys, script, args, env, message):
    status, _, err = run_in_process(monkeypatch, capsys, f"{CH}/{script}", *args, env=env)
    last = err.strip().splitlines()[-1]
    assert status == 2 and message in last, last


def test_ring_attention_on_three_ranks(tmp_path):
    """N = 3: parity in both layouts and dtypes, bytes = the formula (N-1 blocks forward, 2N-1
    backward), and the causal work per rank = distkit.cp.causal_work: contiguous unequal,
    head-tail equal."""
    res, out = run_json(tmp_path, 3, f"{CH}/ring_attention.py", "--seq", "48")
    assert res["world_size"] == 3 and len(res["results"]) == 4
    for name, r in res["results"].items():
        assert r["parity"] and max(r["errors"].values()) < r["tolerance"], name
        assert r["bytes"] == r["formula"], name
        assert r["work"] == r["work formula"], name
    contiguous, head_tail = (res["results"][f"{n} float64"]["work"]
                             for n in ("contiguous", "head-tail"))
    assert len(set(head_tail)) == 1 and contiguous[0] < contiguous[1] < contiguous[2]
    assert "False" not in out


def test_simulation_at_a_small_point(tmp_path):
    """One decoder layer, 4 simulated GPUs: the CP job (cp 2, 8k tokens) and the MoE job at ep
    1 and 2 against distkit.cpep, as the notebook checks the default point."""
    runs = run_scripts_at_once({"sim": (f"{CH}/simulate_cp_ep.py", [
        "--layers", "1", "--cp-gpus", "4", "--cp", "2", "--cp-seq", "8192", "--ep-gpus", "4",
        "--ep", "1,2", "--ep-seq", "512", "--json", tmp_path / "sim.json"], {})})
    status, out, err = runs["sim"]
    assert status == 0, err[-2000:]
    res = json.loads((tmp_path / "sim.json").read_text())["results"]
    cp = res["cp"]
    assert abs(cp["peak"]["Total"] / cp["plan"]["Total"] - 1) < 0.01
    assert cp["all-to-all"] == cp["plan all-to-all"]
    for ep in ("ep1", "ep2"):
        r, p = res[ep], res[ep]["plan"]
        states = sum(r["after_step"].get(k, 0) for k in ("Sharded Param", "Sharded Grad",
                                                          "OptState"))
        assert abs(states / p["states"] - 1) < 0.001, ep
        assert r["gathered layer"] == p["gathered layer"], ep
        assert abs(r["fsdp"] / (p["fsdp dense"] + p["fsdp experts"]) - 1) < 0.001, ep
        assert r["all-to-all"] == p["all-to-all"], ep
    assert res["ep2"]["gathered layer"] < res["ep1"]["gathered layer"]
    assert "limits: CPU code paths" in out


@pytest.mark.second_nproc
def test_expert_parallelism_inside_fsdp2_on_a_2x2_mesh(tmp_path):
    """4 ranks = efsdp 2 x ep 2 (the notebook runs efsdp 1 x ep 2): with FSDP's default average
    every expert gradient is ep = 2 times one process's (review expert_ch09 F6: 2.0x, 1.2e-3);
    with the experts' divide factor N (distkit.moe.apply_ep_fsdp) every gradient matches."""
    res, out = run_json(tmp_path, 4, f"{CH}/moe_ep.py", "--ep", "2")
    assert res["ok"] and res["parity"] and res["fsdp_ok"], out[-2000:]
    wrong, right = res["fsdp"]["FSDP default"], res["fsdp"]["divide N"]
    assert [round(x, 3) for x in wrong["experts_ratio"]] == [2.0, 2.0] and not wrong["parity"]
    assert [round(x, 3) for x in right["experts_ratio"]] == [1.0, 1.0] and right["parity"]
    assert [round(x, 3) for x in right["dense_ratio"]] == [1.0, 1.0]
    assert "mesh efsdp 2 x ep 2" in out


@pytest.mark.second_nproc
def test_fsdp_cp_mean_of_means_is_right_only_with_equal_valid_tokens(tmp_path):
    """No masked label (--prompt 0): every rank holds as many valid labels, and the mean of the
    ranks' means is one process's loss, as the global-token sum is (the notebook runs the masked
    default, where it fails)."""
    res, out = run_json(tmp_path, 4, f"{CH}/fsdp_cp.py", "--prompt", "0", "--steps", "2")
    assert res["ok"] and not res["unequal_valid_tokens"], out[-2000:]
    for method, r in res["results"].items():
        assert all(n["parity"] for n in r["normalisations"].values()), method


@pytest.mark.second_nproc
def test_notebook_at_four_processes_and_the_fast_size(tmp_path):
    """NPROC = 4 with make course FAST=1's size: 4 ranks in every launch (heads, key/value heads
    and experts follow NPROC), 32-token sequences, one simulated layer; every run's own checks
    pass and so do the notebook's asserts (papermill fails on any)."""
    text = run_papermill(tmp_path, "09_context_and_expert_parallelism.ipynb",
                         "-p", "NPROC", "4", "-p", "SIZE", "tiny")
    assert text.count("every check passed: True") == 6
    assert "every check passed: False" not in text
    assert "code/run_w_torchrun.sh 4 ch09_long_context_moe/ring_attention.py --seq 32" in text
