"""A private Redis Cluster on loopback ports: N masters (+ a replica each), killed by PID.

``RedisCluster(masters=3, replicas=1)``: ``redis-server --cluster-enabled yes`` per node, each
with its own ``--cluster-config-file`` in a temp dir, joined by ``redis-cli --cluster create``.
``cluster-node-timeout`` is short (1 s by default) so a killed master's replica takes over
within a few seconds. No persistence.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from redis.crc import key_slot

__all__ = ["RedisCluster"]


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _cluster_ports(count: int) -> list[int]:
    """Free ports P whose cluster-bus port P + 10000 is free too (and below 65536)."""
    ports: list[int] = []
    candidate = 20000 + (os.getpid() * 7) % 20000
    while len(ports) < count:
        candidate = 20000 + (candidate - 20000 + 1) % 25000
        if _bindable(candidate) and _bindable(candidate + 10000):
            ports.append(candidate)
    return ports


def _command(port: int, *args: str, timeout_s: float = 0.5) -> str | None:
    """One inline command to 127.0.0.1:port; the raw reply, or None if it did not answer."""
    with contextlib.suppress(OSError):
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
            sock.sendall((" ".join(args) + "\r\n").encode())
            chunks = []
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                data = sock.recv(65536)
                if not data:
                    break
                chunks.append(data)
                text = b"".join(chunks)
                if text.startswith((b"+", b"-", b":")) and text.endswith(b"\r\n"):
                    break
                if text.startswith(b"$"):
                    header, _, body = text.partition(b"\r\n")
                    if len(body) >= int(header[1:]) + 2:
                        break
            return b"".join(chunks).decode(errors="replace")
    return None


class RedisCluster:
    def __init__(self, masters: int = 3, replicas: int = 1, node_timeout_ms: int = 1000) -> None:
        self.masters = masters
        self.replicas = replicas
        self.node_timeout_ms = node_timeout_ms
        self.ports = _cluster_ports(masters * (1 + replicas))
        self.dir = Path(tempfile.mkdtemp(prefix="redis-cluster-"))
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    @property
    def url(self) -> str:
        """A gateway ``redis_url``: one seed node plus the others as extra seeds."""
        others = ",".join(f"127.0.0.1:{p}" for p in self.ports[1:])
        return f"redis://127.0.0.1:{self.ports[0]}?cluster=true&nodes={others}"

    def _launch(self, port: int) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not on PATH")
        node_dir = self.dir / str(port)
        node_dir.mkdir(exist_ok=True)
        argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--protected-mode", "no", "--cluster-enabled", "yes", "--dir", str(node_dir),
                "--cluster-config-file", str(node_dir / "nodes.conf"),
                "--cluster-node-timeout", str(self.node_timeout_ms),
                # A replica whose link is older than 10 node timeouts refuses to take over; on a
                # loaded machine that can leave a killed master's slots unserved for good.
                "--cluster-replica-validity-factor", "0"]  # fmt: skip
        with (node_dir / "redis.log").open("ab") as log_file:
            self.procs[port] = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT)

    def start(self, timeout_s: float = 30.0) -> RedisCluster:
        for port in self.ports:
            self._launch(port)
        deadline = time.monotonic() + timeout_s
        for port in self.ports:
            while (_command(port, "PING") or "").strip() != "+PONG":
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"cluster node {port} did not answer PING")
                time.sleep(0.05)
        cli = shutil.which("redis-cli")
        if cli is None:
            self.stop()
            raise RuntimeError("redis-cli is not on PATH")
        nodes = [f"127.0.0.1:{p}" for p in self.ports]
        result = subprocess.run(
            [cli, "--cluster", "create", *nodes, "--cluster-replicas", str(self.replicas), "--cluster-yes"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if result.returncode != 0:
            self.stop()
            raise RuntimeError(f"redis-cli --cluster create failed: {result.stdout}{result.stderr}")
        while not self.healthy():
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the cluster did not reach cluster_state:ok")
            time.sleep(0.1)
        return self

    def healthy(self) -> bool:
        """cluster_state:ok on every live node, and every live replica has synced with its master
        (a replica still in its first sync cannot take over when its master is killed)."""
        live = [p for p in self.ports if self.running(p)]
        if not all("cluster_state:ok" in (_command(p, "CLUSTER", "INFO") or "") for p in live):
            return False
        for port in live:
            info = _command(port, "INFO", "replication") or ""
            if "role:slave" in info and "master_link_status:up" not in info:
                return False
        return True

    def running(self, port: int) -> bool:
        proc = self.procs.get(port)
        return proc is not None and proc.poll() is None

    def master_of(self, key: str) -> int | None:
        """The port of the live master serving ``key``'s slot; None while none does (a failover)."""
        slot = key_slot(key.encode())
        for port in self.ports:
            if not self.running(port):
                continue
            nodes = _command(port, "CLUSTER", "NODES", timeout_s=1.0) or ""
            for line in nodes.splitlines():
                fields = line.split()
                if len(fields) < 9 or "master" not in fields[2] or "fail" in fields[2]:
                    continue
                for span in fields[8:]:
                    low, _, high = span.partition("-")
                    if low.isdigit() and int(low) <= slot <= int(high or low):
                        return int(fields[1].split("@")[0].rsplit(":", 1)[1])
        return None

    def kill(self, port: int) -> None:
        """SIGKILL one node by PID (a crash)."""
        proc = self.procs.pop(port, None)
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)

    def stop(self) -> None:
        for port in list(self.procs):
            self.kill(port)
        shutil.rmtree(self.dir, ignore_errors=True)
