"""Prometheus metrics for shmchan channels (the optional extra: `pip install shmchan[metrics]`).

    from prometheus_client import REGISTRY, start_http_server
    from shmchan.metrics import ChannelCollector

    REGISTRY.register(ChannelCollector(["orders"]))   # or ChannelCollector() for every channel
    start_http_server(9108)

Each scrape reads every channel's operators' view (shmchan/inspect.py) from this process,
without slowing its receiver. Every metric has a `channel` label; the deepest lines also
carry a `key` label (at most `top` of them per channel, to bound the series count).
`python -m shmchan stat NAME --prometheus` prints the same metrics once, in the
OpenMetrics text format, for node_exporter's textfile collector.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.openmetrics.exposition import generate_latest
from prometheus_client.registry import Collector, CollectorRegistry

import shmchan

from . import inspect

__all__ = ["ChannelCollector", "openmetrics_text"]

# Stats fields exported as gauges: (field, metric name, help).
_GAUGES = (
    ("capacity", "shmchan_capacity_bytes", "Bytes of message storage."),
    ("used_bytes", "shmchan_used_bytes", "Bytes of the ring not yet reclaimed."),
    (
        "committed_bytes",
        "shmchan_committed_bytes",
        "Bytes of shared memory (or file) backing the channel now.",
    ),
    ("queued", "shmchan_queued_messages", "Messages accepted and not yet handed out."),
    ("inflight", "shmchan_inflight_messages", "Handles handed out and not yet released."),
    ("held_keys", "shmchan_held_keys", "Keys locked by in-flight handles."),
    ("producers", "shmchan_producers", "Live processes registered as senders."),
    ("dead_letters", "shmchan_dead_letters", "Messages that ran out of attempts or expired."),
    ("window", "shmchan_window_messages", "Messages in the receiver's scheduling window."),
    ("delayed", "shmchan_delayed_messages", "Messages held back until their delay ends."),
    ("overflow_bytes", "shmchan_overflow_bytes", "Bytes in the overflow file, not yet taken back."),
    (
        "overflow_messages",
        "shmchan_overflow_messages",
        "Messages in the overflow file, not yet taken back.",
    ),
)
# Stats counters: (field, metric name without _total, help).
_COUNTERS = (
    ("sent", "shmchan_sent_messages", "Messages accepted."),
    ("delivered", "shmchan_delivered_messages", "Handles handed out (redeliveries included)."),
    ("released", "shmchan_released_messages", "Handles released."),
    ("redelivered", "shmchan_redelivered_messages", "Deliveries after the first."),
    ("discarded", "shmchan_discarded_messages", "Reservations of dead producers reclaimed."),
    ("expired", "shmchan_expired_messages", "Messages dead-lettered because their ttl passed."),
)


def _key_label(key: object) -> str:
    return key if isinstance(key, str) else repr(key)


class ChannelCollector(Collector):
    """A prometheus_client collector for some channels (by name), or for every channel
    in /dev/shm (`names=None`). Channels that vanish or cannot be read are skipped."""

    def __init__(self, names: Iterable[str] | None = None, *, top: int = 10) -> None:
        self._names = None if names is None else list(names)
        self._top = top
        self._open: list[tuple[str, shmchan.Channel]] = []

    @classmethod
    def of(cls, ch: shmchan.Channel, name: str, *, top: int = 10) -> ChannelCollector:
        """A collector for one channel this process has open already."""
        collector = cls([], top=top)
        collector._open = [(name, ch)]
        return collector

    def collect(self) -> Iterator[Metric]:
        families = _Families()
        for name, ch in self._open:
            families.add(name, ch, self._top)
        names = shmchan.list_channels() if self._names is None else self._names
        for name in names:
            try:
                ch = shmchan.Channel.open(name)
            except (shmchan.Error, OSError):
                continue
            try:
                families.add(name, ch, self._top)
            except shmchan.Error:
                continue
            finally:
                ch.close()
        yield from families.all()


class _Families:
    """The metric families of one scrape, filled channel by channel."""

    def __init__(self) -> None:
        self.gauges = {
            field: GaugeMetricFamily(metric, text, labels=["channel"])
            for field, metric, text in _GAUGES
        }
        self.counters = {
            field: CounterMetricFamily(metric, text, labels=["channel"])
            for field, metric, text in _COUNTERS
        }
        self.receiver = GaugeMetricFamily(
            "shmchan_receiver_up", "1 while a live process holds the receiver.", labels=["channel"]
        )
        self.oldest = GaugeMetricFamily(
            "shmchan_oldest_held_seconds",
            "Seconds the longest-held key has been held (0: none held).",
            labels=["channel"],
        )
        self.depth = GaugeMetricFamily(
            "shmchan_line_depth_messages",
            "Messages waiting on a key, for the channel's deepest lines.",
            labels=["channel", "key"],
        )
        self.paused = GaugeMetricFamily(
            "shmchan_paused", "1 while the whole channel is paused.", labels=["channel"]
        )
        self.paused_keys = GaugeMetricFamily(
            "shmchan_paused_keys", "Keys paused one by one (pause_key).", labels=["channel"]
        )

    def add(self, name: str, ch: shmchan.Channel, top: int) -> None:
        s = ch.stats()
        held = ch.held()
        lines = ch.waiting(top)
        for field, family in self.gauges.items():
            family.add_metric([name], float(getattr(s, field)))
        for field, counter in self.counters.items():
            counter.add_metric([name], float(getattr(s, field)))
        self.receiver.add_metric([name], 1.0 if inspect.receiver_alive(ch) else 0.0)
        self.oldest.add_metric([name], max((h.age for h in held), default=0.0))
        for line in lines:
            self.depth.add_metric([name, _key_label(line.key)], float(line.depth))
        pst = ch.pause_state()
        self.paused.add_metric([name], 1.0 if pst.paused else 0.0)
        self.paused_keys.add_metric([name], float(len(pst.hashes)))

    def all(self) -> Iterator[Metric]:
        yield from self.gauges.values()
        yield from self.counters.values()
        yield from (self.receiver, self.oldest, self.depth, self.paused, self.paused_keys)


def openmetrics_text(ch: shmchan.Channel, name: str, *, top: int = 10) -> str:
    """One channel's metrics in the OpenMetrics text format (ends with `# EOF`)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ChannelCollector.of(ch, name, top=top))
    text: bytes = generate_latest(registry)  # type: ignore[no-untyped-call]  # untyped upstream
    return text.decode("utf-8")
