"""A real Mooncake Store master for tests and benchmarks: the packaged HTTP metadata
server bound to 127.0.0.1 and ``mooncake_master`` with its RPC and metrics bound to
127.0.0.1, on free ports, stopped by PID.

The master's built-in HTTP metadata server (``--enable_http_metadata_server``) binds
0.0.0.0 whatever ``--http_metadata_server_host`` says (seen with 0.3.13.post1), so it is
not used; the clients' transfer engine also listens on every interface. Tests and the
benchmark therefore run Mooncake inside a private network namespace
(:func:`in_private_netns`, ``docs/remote.md``).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from kvlife.tiers.redis.server import ServerError, free_port, wait_port

NETNS_ENV = "KVLIFE_MOONCAKE_NETNS"
"""Set (to 1) in a process that runs inside the private network namespace."""


def master_binary() -> str:
    try:
        import mooncake
    except ImportError as exc:
        raise ServerError(f"mooncake wheel not installed: {exc}") from exc
    path = Path(mooncake.__file__).parent / "mooncake_master"
    if not path.exists():
        raise ServerError(f"{path} missing from the mooncake wheel")
    return str(path)


def in_private_netns() -> bool:
    return os.environ.get(NETNS_ENV) == "1"


def netns_command(argv: list[str]) -> list[str]:
    """``argv`` run in a fresh network namespace: loopback up, plus a veth pair whose
    ends exist only inside it (Mooncake's transfer engine refuses to start without a
    non-loopback interface: "not valid LAN address found"). Needs root or
    CAP_SYS_ADMIN; ``unshare`` and ``ip`` come from util-linux and iproute2."""
    for tool in ("unshare", "ip"):
        if shutil.which(tool) is None:
            raise ServerError(f"{tool} not found: apt-get install util-linux iproute2")
    inner = " ".join(_quote(a) for a in argv)
    setup = (
        "ip link set lo up && ip link add kvl0 type veth peer name kvl1 && "
        "ip addr add 10.254.0.1/24 dev kvl0 && ip link set kvl0 up && ip link set kvl1 up"
    )
    return ["unshare", "-n", "sh", "-c", f"{setup} && exec env {NETNS_ENV}=1 {inner}"]


def _quote(s: str) -> str:
    return "'" + s.replace("'", "'\\''") + "'"


class MooncakeMaster:
    """Metadata server + master on 127.0.0.1."""

    def __init__(self, workdir: Path) -> None:
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rpc_port = free_port()
        self.http_port = free_port()
        self.metrics_port = free_port()
        self.procs: list[subprocess.Popen[bytes]] = []

    @property
    def master(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def start(self) -> MooncakeMaster:
        log = (self.dir / "metadata.log").open("wb")
        meta = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mooncake.http_metadata_server",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.http_port),
                "--log-level",
                "WARNING",
            ],
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
        self.procs.append(meta)
        wait_port(self.http_port, proc=meta)
        mlog = (self.dir / "master.log").open("wb")
        master = subprocess.Popen(
            [
                master_binary(),
                f"--rpc_port={self.rpc_port}",
                "--rpc_address=127.0.0.1",
                "--metrics_host=127.0.0.1",
                f"--metrics_port={self.metrics_port}",
                "--enable_http_metadata_server=false",
                "--default_kv_lease_ttl=2000",
            ],
            stdout=mlog,
            stderr=mlog,
            start_new_session=True,
        )
        self.procs.append(master)
        wait_port(self.rpc_port, proc=master)
        return self

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                try:
                    os.kill(p.pid, signal.SIGCONT)
                    os.kill(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(timeout=10)
        self.procs.clear()
