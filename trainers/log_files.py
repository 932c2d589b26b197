"""A run directory's logs across crashes: each logged step once after a resume, and read back as TensorBoard shows it.

A resumed run logs again every step after its checkpoint, so :func:`truncate_metrics` drops the
records past the resumed step from ``metrics.jsonl`` (and a line torn by a kill; a guard rollback
keeps the guard's own records), and
:class:`trainers.logger.RunLogger` reopens TensorBoard with ``purge_step``, which hides the old
events from that step on. :func:`read_scalars` reads the event files back with those purges applied.
"""

from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


def truncate_metrics(run_dir: str | Path, step: int, keep_splits: tuple[str, ...] = ()) -> int:
    """Keep the records of ``run_dir/metrics.jsonl`` with ``step <= step``, and those whose split starts
    with one of ``keep_splits`` (rewritten atomically); returns how many were dropped (records past the
    step, and any torn or unreadable line)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                keep = int(record["step"]) <= step or str(record.get("split", "")).startswith(keep_splits or ("\0",))
            except (ValueError, KeyError, TypeError):  # a line torn by a kill
                keep = False
            if keep:
                kept.append(line if line.endswith("\n") else line + "\n")
            else:
                dropped += 1
    if dropped:
        tmp = path.with_name(f".{METRICS_FILE}.tmp")
        tmp.write_text("".join(kept), encoding="utf-8")
        os.replace(tmp, path)
    return dropped


class ScalarWriter:
    """TensorBoard scalars written synchronously (each :meth:`add` is on disk when it returns, so a kill
    loses no logged step); ``purge_step`` hides the events of earlier files at or past it, as
    ``tensorboardX.SummaryWriter(purge_step=)`` does."""

    def __init__(self, logdir: str | Path, purge_step: int | None = None) -> None:
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto.event_pb2 import Event, SessionLog

        os.makedirs(logdir, exist_ok=True)
        self._writer = EventsWriter(os.path.join(str(logdir), "events"), f".{os.getpid()}.{time.time_ns()}")
        if purge_step is not None:
            self._writer.write_event(Event(step=purge_step, wall_time=time.time(),
                                           session_log=SessionLog(status=SessionLog.START)))
        self._writer.flush()

    def add(self, step: int, values: dict[str, float]) -> None:
        """One event holding every ``tag: value`` of ``step``, flushed to disk."""
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.proto.summary_pb2 import Summary

        summary = Summary(value=[Summary.Value(tag=tag, simple_value=value) for tag, value in values.items()])
        self._writer.write_event(Event(step=int(step), wall_time=time.time(), summary=summary))
        self._writer.flush()

    def add_text(self, tag: str, text: str, global_step: int) -> None:
        """A text entry (TensorBoard's text tab), flushed to disk."""
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.summary import text as text_summary

        self._writer.write_event(Event(step=int(global_step), wall_time=time.time(), summary=text_summary(tag, text)))
        self._writer.flush()

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def _records(data: bytes):
    """TFRecord payloads (u64 length, u32 crc, payload, u32 crc); stops at a record torn by a kill."""
    off = 0
    while off + 12 <= len(data):
        (length,) = struct.unpack("<Q", data[off:off + 8])
        end = off + 12 + length + 4
        if end > len(data):
            return
        yield data[off + 12:off + 12 + length]
        off = end


def read_scalars(run_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """``{tag: [(step, value), ...]}`` of ``run_dir/tensorboard`` as TensorBoard shows it: event files in
    the order they were written, and a restart's ``purge_step`` hiding earlier events at or past it."""
    from tensorboardX.proto.event_pb2 import Event, SessionLog

    scalars: dict[str, list[tuple[int, float]]] = {}
    files = []
    for path in (Path(run_dir) / TENSORBOARD_DIR).glob("events.out.tfevents.*"):
        events = []
        for payload in _records(path.read_bytes()):
            events.append(Event())
            events[-1].ParseFromString(payload)
        files.append((events[0].wall_time if events else 0.0, path.name, events))
    for _, _, events in sorted(files, key=lambda f: f[:2]):  # in the order they were started
        for event in events:
            if event.HasField("session_log") and event.session_log.status == SessionLog.START:
                scalars = {tag: [(s, v) for s, v in rows if s < event.step] for tag, rows in scalars.items()}
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((int(event.step), float(value.simple_value)))
    return scalars
