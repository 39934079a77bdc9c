"""kvtier.testing: a real kvtierd for tests and examples.

Daemon starts the kvtierd binary on port 0 with a fresh data directory, learns its ports
from the port file it writes once it serves, and stops it with SIGTERM or SIGKILL. A
daemon still running when its Daemon is garbage-collected or the interpreter exits is
killed then, so a script that forgets stop() leaves nothing behind. The
binary is $KVTIERD_BINARY, else the build tree's (build/server/kvtierd next to the
package in build/python), else kvtierd on PATH.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
import weakref
from pathlib import Path
from typing import List, Optional


def find_kvtierd() -> str:
    env = os.environ.get("KVTIERD_BINARY")
    if env:
        return env
    here = Path(__file__).resolve().parent  # build/python/kvtier in the build tree.
    candidate = here.parent.parent / "server" / "kvtierd"
    if candidate.is_file():
        return str(candidate)
    found = shutil.which("kvtierd")
    if found:
        return found
    raise FileNotFoundError("kvtierd not found: build it, or set KVTIERD_BINARY")


def _reap(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


class Daemon:
    """A kvtierd child process. Use as a context manager, or call stop()."""

    def __init__(self, data_dir: Optional[str] = None, args: Optional[List[str]] = None,
                 binary: Optional[str] = None, start_timeout: float = 30.0):
        self._own_dir = data_dir is None
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="kvtierd-")
        self.args = list(args or [])
        self.binary = binary or find_kvtierd()
        self.start_timeout = start_timeout
        self.port = 0
        self.metrics_port = 0
        self.proc: Optional[subprocess.Popen] = None
        self._reaper: Optional[weakref.finalize] = None
        self.log_path = self.data_dir + ".log"
        self.start()

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        """Starts (or restarts, on the same data directory) and waits until it serves."""
        port_file = os.path.join(self.data_dir, "kvtierd.port")
        if os.path.exists(port_file):
            os.unlink(port_file)
        argv = [self.binary, "--listen=127.0.0.1:0", "--metrics-listen=127.0.0.1:0",
                f"--data-dir={self.data_dir}", f"--port-file={port_file}"] + self.args
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        log.close()
        # Holds the process, not self: runs when self is collected, or at exit.
        self._reaper = weakref.finalize(self, _reap, self.proc)
        deadline = time.monotonic() + self.start_timeout
        # Polls for the port file: the daemon renames it into place whole once it
        # serves. This waits for a process to start; it orders nothing in a test.
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvtierd exited with {self.proc.returncode}: {self.read_log()}")
            try:
                lines = Path(port_file).read_text().split("\n")
                self.port, self.metrics_port = int(lines[0]), int(lines[1])
                if self.port > 0:
                    return
            except (FileNotFoundError, ValueError, IndexError):
                pass
            time.sleep(0.01)
        self.kill()
        raise RuntimeError(f"kvtierd did not serve within {self.start_timeout} s: {self.read_log()}")

    def read_log(self) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM and wait; returns the exit code."""
        if self.proc is None:
            return 0
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout)
        self._forget()
        return code

    def kill(self) -> None:
        """SIGKILL and reap."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self._forget()

    def _forget(self) -> None:
        self.proc = None
        if self._reaper is not None:
            self._reaper.detach()
            self._reaper = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def close(self) -> None:
        self.kill()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            try:
                os.unlink(self.log_path)
            except FileNotFoundError:
                pass

    def __enter__(self) -> "Daemon":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
