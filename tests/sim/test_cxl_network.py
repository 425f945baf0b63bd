"""Device models behind the common interface: one contract suite, then each model's behaviour."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvlife.sim.cxl import CXLSSD, CXLDramConfig, CXLDramExpander, CXLSSDConfig
from kvlife.sim.device import DeviceModel, DeviceStats, LocalDRAM, MemoryConfig
from kvlife.sim.errors import ClockOrderError, RequestError
from kvlife.sim.network import RDMA_100G, TCP_25G, NetworkLink, NetworkLinkConfig
from kvlife.sim.ssd import SSDConfig, SSDModel

FACTORIES: dict[str, Callable[[], DeviceModel[DeviceStats]]] = {
    "dram": LocalDRAM,
    "cxl-dram": CXLDramExpander,
    "cxl-ssd": lambda: CXLSSD(CXLSSDConfig(cache_bytes=64 * 4096)),
    "net-rdma": lambda: NetworkLink(RDMA_100G),
    "net-tcp": lambda: NetworkLink(TCP_25G),
    "ssd": lambda: SSDModel(SSDConfig(n_blocks=64, op=0.5, page_bytes=4096, block_bytes=16 * 4096)),
}


@pytest.fixture(params=sorted(FACTORIES))
def device(request: pytest.FixtureRequest) -> DeviceModel[DeviceStats]:
    return FACTORIES[request.param]()


class TestContract:
    """What every DeviceModel promises."""

    def test_completion_is_never_before_the_request(self, device: DeviceModel[DeviceStats]) -> None:
        t = 0.0
        for i in range(20):
            t += 1e-6
            assert device.write(t, 4096 * (1 + i % 3), key=i) >= t
            assert device.read(t, 4096, key=i) > t

    def test_stats_count_requests_and_bytes(self, device: DeviceModel[DeviceStats]) -> None:
        device.write(0.0, 8192, key=1)
        device.read(0.1, 4096, key=1)
        device.read(0.2, 4096, key=1)
        device.trim(1)
        device.delete(2)
        s = device.stats()
        assert (s.reads, s.writes, s.trims) == (2, 1, 2)
        assert (s.bytes_read, s.bytes_written) == (8192, 8192)
        assert s.read_latency.count == 2
        assert s.write_latency.count == 1
        assert 0 < s.read_latency.p50_s <= s.read_latency.p99_s <= s.read_latency.max_s

    def test_requests_from_the_past_are_refused(self, device: DeviceModel[DeviceStats]) -> None:
        device.write(1.0, 4096, key=1)
        with pytest.raises(ClockOrderError, match="earlier than the previous"):
            device.read(0.5, 4096, key=1)
        # Equal times are fine (FCFS in call order).
        device.read(1.0, 4096, key=1)

    @pytest.mark.parametrize("nbytes", [-1, 1.5])
    def test_bad_sizes_are_refused(self, device: DeviceModel[DeviceStats], nbytes: float) -> None:
        with pytest.raises(RequestError, match="nbytes"):
            device.write(0.0, nbytes, key=1)  # type: ignore[arg-type]

    @pytest.mark.parametrize("t", [float("nan"), float("inf"), -1.0])
    def test_bad_times_are_refused(self, device: DeviceModel[DeviceStats], t: float) -> None:
        with pytest.raises(RequestError, match="t_now"):
            device.read(t, 4096, key=1)

    def test_trim_is_idempotent(self, device: DeviceModel[DeviceStats]) -> None:
        device.write(0.0, 4096, key=7)
        device.trim(7)
        device.trim(7)
        assert device.read(0.1, 4096, key=7) >= 0.1

    def test_concurrent_requests_queue(self, device: DeviceModel[DeviceStats]) -> None:
        # Many large writes issued at once cannot all finish as fast as one alone.
        first = device.write(0.0, 1 << 16, key=0)
        last = first
        for k in range(1, 32):
            last = device.write(0.0, 1 << 16, key=k)
        assert last > first


def test_dram_latency_and_bandwidth() -> None:
    dram = LocalDRAM(MemoryConfig(latency_s=100e-9, bandwidth_bytes_per_s=100e9))
    assert dram.read(0.0, 64, 0) == pytest.approx(100e-9 + 64 / 100e9)
    # Two 1 MB transfers at the same time: the second waits for the first's bandwidth.
    a = dram.read(1.0, 1_000_000, 0)
    b = dram.read(1.0, 1_000_000, 1)
    assert a - 1.0 == pytest.approx(10e-6 + 100e-9)
    assert b - 1.0 == pytest.approx(20e-6 + 100e-9)


def test_cxl_dram_is_two_to_three_times_local_dram_latency() -> None:
    local = LocalDRAM().read(0.0, 64, 0)
    cxl = CXLDramExpander().read(0.0, 64, 0)
    assert 2.0 <= cxl / local <= 3.0
    # And its bandwidth is lower: a 64 MiB read takes longer.
    assert CXLDramExpander().read(0.0, 1 << 26, 0) > 2 * LocalDRAM().read(0.0, 1 << 26, 0)


def test_cxl_dram_config_is_used() -> None:
    dev = CXLDramExpander(CXLDramConfig(latency_s=300e-9, bandwidth_bytes_per_s=10e9))
    assert dev.read(0.0, 0, 0) == pytest.approx(300e-9)


def test_cxl_ssd_loads_are_bimodal() -> None:
    cfg = CXLSSDConfig(cache_bytes=16 * 4096, cache_page_bytes=4096, flash_units=4)
    dev = CXLSSD(cfg)
    t = 0.0
    dev.write(t, 4096, key=0)
    t += 1e-3
    hit = dev.read(t, 64, key=0) - t
    assert hit < 1e-6  # sub-microsecond from device DRAM
    # Push key 0 out of the 16-page cache with 32 other pages.
    for k in range(1, 33):
        t += 1e-3
        dev.write(t, 4096, key=k)
    t += 1e-3
    miss = dev.read(t, 64, key=0) - t
    assert 10e-6 <= miss <= 100e-6  # tens of microseconds from NAND
    t += 1e-3
    assert dev.read(t, 64, key=0) - t < 1e-6  # cached again
    s = dev.stats()
    assert (s.cache_hits, s.cache_misses) == (2, 1)
    assert s.hit_ratio == pytest.approx(2 / 3)
    assert s.writebacks >= 17  # dirty pages evicted to NAND


def test_cxl_ssd_misses_queue_on_flash_units() -> None:
    cfg = CXLSSDConfig(cache_bytes=4096, flash_units=1, flash_read_s=20e-6)
    dev = CXLSSD(cfg)
    for k in range(8):
        dev.write(0.0, 4096, key=k)
    # All eight reads at the same time miss (the cache holds one page) and share one unit.
    done = [dev.read(1.0, 4096, key=k) - 1.0 for k in range(8)]
    assert done[-1] >= 8 * 20e-6
    assert done == sorted(done)


def test_cxl_ssd_trim_drops_data_without_writeback() -> None:
    dev = CXLSSD(CXLSSDConfig(cache_bytes=8 * 4096))
    dev.write(0.0, 4 * 4096, key=1)
    dev.trim(1)
    dev.read(0.1, 4 * 4096, key=1)
    s = dev.stats()
    assert s.writebacks == 0
    assert s.unmapped_page_reads == 4
    assert s.cache_misses == 0


def test_network_small_message_costs_rtt_and_overhead() -> None:
    cfg = NetworkLinkConfig(bandwidth_bytes_per_s=10e9, rtt_s=10e-6, per_message_overhead_s=2e-6)
    link = NetworkLink(cfg)
    assert link.read(0.0, 0, 0) == pytest.approx(12e-6)
    assert link.write(1.0, 0, 0) - 1.0 == pytest.approx(12e-6)
    # A 10 MB fetch is dominated by serialization: 1 ms plus the fixed costs.
    assert link.read(2.0, 10_000_000, 0) - 2.0 == pytest.approx(1e-3 + 12e-6)


def test_network_messages_queue_per_direction() -> None:
    cfg = NetworkLinkConfig(bandwidth_bytes_per_s=1e9, rtt_s=0.0, per_message_overhead_s=0.0)
    link = NetworkLink(cfg)
    reads = [link.read(0.0, 1_000_000, k) for k in range(4)]
    assert reads == pytest.approx([1e-3, 2e-3, 3e-3, 4e-3])
    # Writes use the other direction of the full-duplex link: no wait behind the reads.
    assert link.write(0.0, 1_000_000, 9) == pytest.approx(1e-3)
    s = link.stats()
    assert s.messages == 5
    assert s.queue_delay.max_s == pytest.approx(3e-3)
    assert s.busy_in_s == pytest.approx(4e-3)
    assert s.busy_out_s == pytest.approx(1e-3)


def test_rdma_beats_tcp_for_small_messages() -> None:
    assert NetworkLink(RDMA_100G).read(0.0, 4096, 0) < NetworkLink(TCP_25G).read(0.0, 4096, 0) / 5
