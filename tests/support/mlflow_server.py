"""A real `mlflow server` for tests: SQLite backend, proxied artifacts, 127.0.0.1, a free port.

Reuse from any test module:

    from mlflow_server import mlflow_server, mlflow_uri  # noqa: F401  (fixtures)

    def test_x(mlflow_uri): ...   # "http://127.0.0.1:<port>", running

`mlflow_server` is the session's `MlflowServer` (uri, db_uri, stop(kill=True),
ensure_running()); `start_mlflow_server(dir)` / `stop_mlflow_server(proc)` give a server of
your own.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

START_TIMEOUT_S = 90.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(uri: str) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(f"{uri}/health", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


def start_mlflow_server(root: str | os.PathLike, port: int | None = None,
                        timeout_s: float = START_TIMEOUT_S) -> tuple[str, subprocess.Popen]:
    """Start `mlflow server` storing in `root`; wait (bounded) for /health. -> (uri, process).

    Restarting on the same root and port continues the same database and artifacts.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    uri = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
           "--workers", "1", "--backend-store-uri", f"sqlite:///{root.resolve() / 'mlflow.db'}",
           "--serve-artifacts", "--artifacts-destination", str(root.resolve() / "artifacts")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"  # no job-runner process: starts 2x faster
    with open(root / "server.log", "ab") as log:
        # own process group: stopping it also stops uvicorn's worker
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _healthy(uri):
            return uri, proc
        if proc.poll() is not None:
            break
        time.sleep(0.25)
    stop_mlflow_server(proc)
    tail = (root / "server.log").read_text(errors="replace")[-3000:]
    raise RuntimeError(f"mlflow server did not become healthy at {uri} within {timeout_s:.0f} s "
                       f"(exit code {proc.returncode}); log tail:\n{tail}")


def _leader_exited(proc: subprocess.Popen) -> bool:
    """Has the group leader exited? Leaves it unreaped, so its group id cannot be reused."""
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is not None
    except ChildProcessError:
        return True


def stop_mlflow_server(proc: subprocess.Popen, kill: bool = False, wait_s: float = 10.0) -> None:
    """Terminate (or, kill=True, SIGKILL at once) the server's process group and reap it."""
    if proc.returncode is None:  # not reaped yet: the group id is still ours
        os.killpg(proc.pid, signal.SIGKILL if kill else signal.SIGTERM)
        deadline = time.monotonic() + wait_s
        while not _leader_exited(proc) and time.monotonic() < deadline:
            time.sleep(0.05)
        try:  # the leader if it ignored SIGTERM, and any worker left behind
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


class MlflowServer:
    """A restartable server: the same URI, database and artifacts across kill/restart."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    @property
    def db_uri(self) -> str:
        """The backend database, readable with MlflowClient even while the server is down."""
        return f"sqlite:///{self.root.resolve() / 'mlflow.db'}"

    def ensure_running(self) -> str:
        if self.proc is None or self.proc.poll() is not None:
            _, self.proc = start_mlflow_server(self.root, self.port)
        return self.uri

    def stop(self, kill: bool = False) -> None:
        if self.proc is not None:
            stop_mlflow_server(self.proc, kill=kill)
            self.proc = None


_shared: MlflowServer | None = None  # one server even when several modules import the fixture


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory) -> MlflowServer:
    """The session's MLflow tracking server, started on first `ensure_running()` (a test may
    kill it: `mlflow_uri` restarts it on the same port and database)."""
    global _shared
    if _shared is None:
        _shared = MlflowServer(tmp_path_factory.mktemp("mlflow_server"))
    try:
        yield _shared
    finally:
        _shared.stop()


@pytest.fixture
def mlflow_uri(mlflow_server) -> str:
    """URI of the session's MLflow server, (re)started if needed."""
    return mlflow_server.ensure_running()
