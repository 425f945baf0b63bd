"""Session fixtures for the Mooncake tests, which run only inside the private network
namespace that tests/remote/test_mooncake.py starts (Mooncake binds every interface)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvlife.store import TierSpec
from kvlife.tiers.mooncake.server import MooncakeMaster, in_private_netns


@pytest.fixture(scope="session")
def mooncake_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeMaster]:
    if not in_private_netns():
        pytest.skip("Mooncake runs inside a private network namespace (test_mooncake.py)")
    m = MooncakeMaster(tmp_path_factory.mktemp("mooncake")).start()
    yield m
    m.stop()


def mooncake_spec(request: pytest.FixtureRequest, cap: int, ns: str) -> TierSpec:
    m: MooncakeMaster = request.getfixturevalue("mooncake_master")
    redis = request.getfixturevalue("redis_server")
    return TierSpec(
        "mooncake",
        "mooncake",
        cap,
        options=(
            ("master", m.master),
            ("metadata", m.metadata),
            ("index", redis.url),
            ("index_namespace", ns),
            ("segment_bytes", 64 << 20),
        ),
    )
