"""`mtrain serve` as a real process on a free localhost port, for the server's tests."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT = 300  # a loaded 2-core machine may take a while to import torch and load the model


@dataclass
class Server:
    url: str  # http://127.0.0.1:PORT
    process: subprocess.Popen
    stderr: list[str] = field(default_factory=list)  # drained by a thread, so that the pipe never fills

    def __post_init__(self):
        self.reader = threading.Thread(target=lambda: self.stderr.extend(self.process.stderr), daemon=True)
        self.reader.start()

    def stop(self) -> tuple[int, str]:
        """SIGINT (Ctrl-C), then the exit code and what it printed on stderr after starting."""
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.reader.join(timeout=30)
        return self.process.returncode, "".join(self.stderr)


@contextlib.contextmanager
def running_server(load: Path, *args: str) -> Iterator[Server]:
    """`python -m mtrain serve --load LOAD --port 0 ARGS`, stopped at the end; the first stderr line names the URL."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "mtrain", "serve", "--load", str(load), "--host", "127.0.0.1",
                             "--port", "0", *args], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    server = None
    watchdog = threading.Timer(START_TIMEOUT, proc.kill)  # a server that never starts fails the test, not hangs it
    watchdog.start()
    try:
        line = proc.stderr.readline()  # "serving … at http://127.0.0.1:PORT/api (PUT) and …"
        watchdog.cancel()
        if " at http://127.0.0.1:" not in line:
            proc.kill()
            raise AssertionError(line + proc.communicate(timeout=60)[1][-3000:])
        server = Server(line.split(" at ")[1].split()[0].removesuffix("/api"), proc)
        yield server
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            (server.stop() if server else proc.kill())


def request(url: str, body: object = None, method: str = "POST", headers: dict | None = None,
            timeout: float = 120) -> tuple[int, dict]:
    """(status, decoded JSON answer); `body` bytes are sent as they are, anything else as JSON."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
