"""tests/sanitize.cfg, applied as nbval applies it (nbval's own parser, then re.sub of every rule
in order): each rule rewrites what differs from run to run and keeps a line it must not touch."""
import re
from pathlib import Path

import pytest
from nbval.plugin import get_sanitize_patterns

CFG = Path(__file__).with_name("sanitize.cfg")


def rules() -> dict:
    """section name -> (regex, replacement), as nbval reads them."""
    text = CFG.read_text()
    names = re.findall(r"^\[(\w+)\]$", text, re.M)
    patterns = get_sanitize_patterns(text)
    # a rule nbval cannot parse (e.g. a bare "replace:") is dropped without a word: none may be
    assert len(patterns) == len(names), (names, patterns)
    return dict(zip(names, patterns))


def sanitize(text: str) -> str:
    for regex, replace in get_sanitize_patterns(CFG.read_text()):
        text = re.sub(regex, replace, text)
    return text


# rule -> (a line it must rewrite, what the whole file makes of it), [lines every rule keeps]
CASES = {
    "ports": (("MASTER_ADDR=localhost  MASTER_PORT=40835\n",
               "MASTER_ADDR=localhost  MASTER_PORT=PORT\n"),
              ["all_reduce of 16 MiB exact on every rank: True\n", "exported 2 ports\n"]),
    "ipv4": (("Connection closed by peer [10.1.2.3]:6554\n",
              "Connection closed by peer [IP]:6554\n"),
             ["torch 2.13.0+cpu\n", "version 1.2.3\n"]),
    "memory_addresses": (("<Linear object at 0x7f3a2c1d5e10>\n", "<Linear object at 0xADDR>\n"),
                         ["<Figure size 650x600 with 1 Axes>\n", "mask 0xff\n"]),
    "torchrun_log_lines": (
        ("a\n[W1125 10:51:04.123456 1234 TCPStore.cpp:125] Connection was likely closed\nb\n",
         "a\nb\n"),
        ["E1125 10:51:04.123000 1234 torch/distributed/elastic/api.py:1] failed (exitcode: 1)\n",
         "[E1125 10:51:04.123456 1234 ProcessGroupGloo.cpp:1] Connection closed by peer\n"]),
    "durations": (("step took 0.0123 s, all-reduce 1.5e-03 s\n",
                   "step took DURATION, all-reduce DURATION\n"),
                  ["[rank 1] slept 0.3 s; left only after the last rank arrived: True\n",
                   "smoke test: 2 ranks, timeout 30 s\n", "timed out after 5000ms\n",
                   '+        print0(f"{schedule_name:5s} epoch {epoch}")\n']),
    "rates": (("bus bandwidth 3.25 GB/s, 1.631GB/s\n", "bus bandwidth RATE, RATE\n"),
              ["batch of 3 GB\n", "H100 SXM  989 TFLOP/s, NVLink 450 GB/s each way\n",
               "IB NDR / RoCE 400G    50 GB/s each way per GPU\n", "HBM 3.4 TB/s\n"]),
}


def test_every_rule_is_read_by_nbval_and_tested():
    assert sorted(rules()) == sorted(CASES)


@pytest.mark.parametrize("name", CASES)
def test_rule_rewrites_what_differs_and_keeps_the_rest(name):
    (line, want), keep = CASES[name]
    regex, replace = rules()[name]
    assert re.search(regex, line), f"{name} does not match {line!r}"
    assert sanitize(line) == want
    for kept in keep:
        assert sanitize(kept) == kept, name
