#!/usr/bin/python3
"""Which system calls of a traced kvtierd would the shipped unit's seccomp filter deny?

usage: unit_syscalls.py UNIT STRACE_OUTPUT

UNIT is deploy/kvtierd.service; STRACE_OUTPUT is `strace -f -qq -o FILE kvtierd ...`.
The unit's SystemCallFilter= lines are applied as systemd applies them: the first
(allow-list) line sets what is allowed, each later line adds to it, and each line
starting with `~` removes its calls; groups (@name) are expanded, recursively, with
`systemd-analyze syscall-filter`. Exits 1 and names every traced call the filter denies
(under SystemCallErrorNumber=EPERM the daemon would see EPERM there), 0 otherwise.
"""
import re
import subprocess
import sys

_cache = {}


def expand(name):
    """The system calls of a group (@x) or of a single call, as a set of names."""
    if not name.startswith("@"):
        return {name}
    if name not in _cache:
        out = subprocess.run(["systemd-analyze", "syscall-filter", name], check=True,
                             capture_output=True, text=True).stdout
        calls = set()
        for line in out.splitlines()[1:]:
            item = line.strip()
            if not item or item.startswith("#"):
                continue
            calls |= expand(item) if item.startswith("@") else {item}
        if not calls:
            sys.exit(f"systemd-analyze knows no system call group {name}")
        _cache[name] = calls
    return _cache[name]


def allowed_calls(unit_text):
    allowed = None
    for line in unit_text.splitlines():
        m = re.match(r"^\s*SystemCallFilter=(.*)$", line)
        if not m:
            continue
        value = m.group(1).strip()
        deny = value.startswith("~")
        names = set()
        for item in value.lstrip("~").split():
            names |= expand(item)
        if deny:
            if allowed is None:
                sys.exit("the unit denies calls without an allow-list first; this check "
                         "handles only allow-list filters")
            allowed -= names
        else:
            allowed = names if allowed is None else allowed | names
    if allowed is None:
        sys.exit("the unit has no SystemCallFilter= allow-list")
    return allowed


def traced_calls(trace_text):
    calls = set()
    for line in trace_text.splitlines():
        m = re.match(r"^\d+\s+([a-z_][a-z0-9_]*)\(", line)
        if m:
            calls.add(m.group(1))
    return calls


def main():
    unit, trace = sys.argv[1:3]
    allowed = allowed_calls(open(unit).read())
    used = traced_calls(open(trace).read())
    if not used:
        sys.exit(f"no system calls in {trace}: was it written by strace -f -o?")
    denied = sorted(used - allowed)
    print(f"{len(used)} distinct system calls traced, {len(allowed)} allowed by the unit")
    if denied:
        print("the unit's SystemCallFilter denies: " + " ".join(denied))
        return 1
    print("OK: every traced system call is allowed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
