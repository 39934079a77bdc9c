"""The README's "A worker's first ten lines" block, run as written against a real kvtierd.

The block is read from README.md (not copied here), its target swapped for the test
daemon's; it runs twice: the first run finds nothing and stores three chunks, the second
finds all three and loads them back bit for bit.
"""

import os
import re

import pytest
import torch

import kvtier

README = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..",
                      "README.md")


def readme_block():
    text = open(README, encoding="utf-8").read()
    section = text.split("### A worker's first ten lines", 1)
    assert len(section) == 2, "README lost its 'A worker's first ten lines' section"
    m = re.search(r"```python\n(.*?)```", section[1], re.S)
    assert m, "no python block in the section"
    return m.group(1)


def test_the_block_is_ten_lines_of_code():
    code = [l for l in readme_block().splitlines() if l.strip() and not l.startswith("#")]
    assert len(code) <= 12, code


def test_readme_block_runs_twice_against_a_real_daemon(daemon):
    block = readme_block()
    assert '"127.0.0.1:50051"' in block
    block = block.replace('"127.0.0.1:50051"', repr(daemon.target))
    first, second = {}, {}
    exec(compile(block, "README.md", "exec"), first)
    assert first["hits"] == 0 and len(first["keys"]) == 3
    stored = first["kv"].clone()
    exec(compile(block, "README.md", "exec"), second)
    assert second["hits"] == 3
    # Loaded in place, the same bits the first run computed and stored.
    assert torch.equal(second["kv"], stored)
    first["client"].close()
    second["client"].close()
