"""MetricsLogger (JSONL + TensorBoard records), the progress line's ETA, and the Timeline trace."""

import json
import math
import os
import struct
import threading
import time

import numpy as np
import pytest

from areal_jax.metrics import MetricsLogger, Timeline, format_duration, format_progress


def _crc32c(data: bytes) -> int:
    """Castagnoli CRC, bit by bit (slow, independent of tensorboardX's table implementation)."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def _masked(crc: int) -> int:
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def _read_records(path: str) -> list[bytes]:
    """TFRecord framing: u64 length, u32 masked crc(length), data, u32 masked crc(data)."""
    records = []
    with open(path, "rb") as f:
        blob = f.read()
    pos = 0
    while pos < len(blob):
        header = blob[pos:pos + 8]
        (length,) = struct.unpack("<Q", header)
        (len_crc,) = struct.unpack("<I", blob[pos + 8:pos + 12])
        assert len_crc == _masked(_crc32c(header))
        data = blob[pos + 12:pos + 12 + length]
        (data_crc,) = struct.unpack("<I", blob[pos + 12 + length:pos + 16 + length])
        assert data_crc == _masked(_crc32c(data))
        records.append(data)
        pos += 16 + length
    return records


def test_crc32c_reference_value():
    assert _crc32c(b"123456789") == 0xE3069283  # the standard check value of CRC-32C


def _strict_json(line: str):
    def reject(constant):
        raise ValueError(f"non-standard JSON constant {constant}")
    return json.loads(line, parse_constant=reject)


def test_jsonl_and_tensorboard_hold_what_was_logged(tmp_path):
    logger = MetricsLogger(tmp_path / "run", total_steps=10)
    assert logger.enabled
    logged = [
        (1, {"loss": 0.5, "reward": np.float32(0.25), "eval": {"accuracy": 0.75}, "note": "warm"}),
        (2, {"loss": 0.25, "reward": np.array(0.5), "eval": {"accuracy": 1.0},
             "lengths": np.array([3, 4])}),
        (3, {"loss": float("nan"), "reward": 1, "eval": {"accuracy": 0.5}}),
    ]
    t_before = time.time()
    for step, metrics in logged:
        logger.log(step, metrics)
    logger.close()

    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    records = [_strict_json(line) for line in lines]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [r["loss"] for r in records] == [0.5, 0.25, None]  # NaN -> null in strict JSON
    assert [r["reward"] for r in records] == [0.25, 0.5, 1]
    assert [r["eval/accuracy"] for r in records] == [0.75, 1.0, 0.5]
    assert records[0]["note"] == "warm" and records[1]["lengths"] == [3, 4]
    assert all(t_before - 1 <= r["time"] <= time.time() + 1 for r in records)
    assert all(r["elapsed_s"] >= 0 for r in records)

    from tensorboardX.proto.event_pb2 import Event

    event_files = [f for f in os.listdir(tmp_path / "run") if f.startswith("events.out.tfevents")]
    assert len(event_files) == 1
    scalars: dict[str, dict[int, float]] = {}
    for data in _read_records(str(tmp_path / "run" / event_files[0])):
        event = Event.FromString(data)
        for value in event.summary.value:
            scalars.setdefault(value.tag, {})[event.step] = value.simple_value
    assert scalars["loss"][1] == 0.5 and scalars["loss"][2] == 0.25 and math.isnan(scalars["loss"][3])
    assert scalars["reward"] == {1: 0.25, 2: 0.5, 3: 1.0}
    assert scalars["eval/accuracy"] == {1: 0.75, 2: 1.0, 3: 0.5}
    assert "note" not in scalars and "lengths" not in scalars


def test_disabled_logger_writes_nothing(tmp_path):
    logger = MetricsLogger(tmp_path / "run", enabled=False, total_steps=4)
    record = logger.log(1, {"loss": 1.0})
    assert record["loss"] == 1.0
    assert "step 1/4" in logger.progress_line(1, {"loss": 1.0})
    logger.close()
    assert not (tmp_path / "run").exists()


def test_eta_and_progress_line_by_hand():
    # 25 of 100 steps in 50 s: 2 s per step, 75 steps left -> 150 s.
    metrics = {"reward": 0.51234, "eval": {"accuracy": 0.43}, "tokens_per_s": 1234.4,
               "staleness": 1.2, "loss": 3.0}
    line = format_progress(25, 100, 50.0, metrics)
    assert line == ("step 25/100 | elapsed 50s | ETA 2m30s | reward 0.512 | acc 0.430 | "
                    "1,234 tok/s | staleness 1.200")
    # Resumed at step 20: 5 steps in 50 s -> 10 s per step, 75 left -> 750 s.
    assert "ETA 12m30s" in format_progress(25, 100, 50.0, {}, start_step=20)
    # Unknown total or no finished step: no ETA; missing headline keys are left out.
    assert format_progress(7, None, 3.0, {"reward": 1.0}) == "step 7 | elapsed 3s | reward 1.000"
    assert format_progress(0, 100, 1.0, {}) == "step 0/100 | elapsed 1s"
    assert [format_duration(s) for s in (0, 59.4, 150, 3725)] == ["0s", "59s", "2m30s", "1h02m"]


def _check_nesting(spans):
    """Spans of one lane must be disjoint or contained (a proper call tree)."""
    stack: list[tuple[int, int]] = []
    for ev in sorted(spans, key=lambda e: (e["ts"], -e["dur"])):
        start, end = ev["ts"], ev["ts"] + ev["dur"]
        while stack and start >= stack[-1][1]:
            stack.pop()
        if stack:
            assert end <= stack[-1][1], f"span {ev['name']} overlaps its parent"
        stack.append((start, end))


def test_timeline_nested_spans_from_two_threads(tmp_path):
    timeline = Timeline(tmp_path / "timeline.json")

    def work(lane: str) -> None:
        for i in range(5):
            with timeline.span("step", lane=lane, index=i):
                with timeline.span("forward", lane=lane):
                    time.sleep(0.001)
                with timeline.span("backward", lane=lane, shape=(2, 3)):
                    with timeline.span("allreduce", lane=lane):
                        time.sleep(0.001)

    threads = [threading.Thread(target=work, args=(lane,)) for lane in ("sampler", "trainer")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with pytest.raises(KeyError):
        with timeline.span("failing", lane="main"):
            raise KeyError("boom")
    timeline.instant("weights_updated", lane="main", version=3)
    path = timeline.save()

    trace = json.loads(open(path).read())
    events = trace["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] == "thread_name"}
    assert sorted(names.values()) == ["main", "sampler", "trainer"]
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == 2 * 5 * 4 + 1
    for e in spans:
        assert isinstance(e["ts"], int) and isinstance(e["dur"], int) and e["dur"] >= 0
        assert e["pid"] == os.getpid()
    for tid, lane in names.items():
        lane_spans = [e for e in spans if e["tid"] == tid]
        _check_nesting(lane_spans)
        if lane != "main":
            assert len(lane_spans) == 20
            steps = [e for e in lane_spans if e["name"] == "step"]
            assert [e["args"]["index"] for e in sorted(steps, key=lambda e: e["ts"])] == [0, 1, 2, 3, 4]
            for child in (e for e in lane_spans if e["name"] != "step"):
                assert any(s["ts"] <= child["ts"] and child["ts"] + child["dur"] <= s["ts"] + s["dur"]
                           for s in steps)
    assert [e["name"] for e in spans if names[e["tid"]] == "main"] == ["failing"]
    instants = [e for e in events if e["ph"] == "i"]
    assert instants[0]["name"] == "weights_updated" and instants[0]["args"] == {"version": 3}


def test_timeline_memory_is_bounded_and_spooled(tmp_path):
    timeline = Timeline(tmp_path / "t.json", max_buffered=8, max_events=30)
    for i in range(50):
        with timeline.span("tick", lane="a", i=i):
            pass
        assert len(timeline.events()) <= 8
    assert os.path.exists(tmp_path / "t.json.spool")
    timeline.close()
    assert not os.path.exists(tmp_path / "t.json.spool")
    trace = json.load(open(tmp_path / "t.json"))
    ticks = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [e["args"]["i"] for e in ticks] == list(range(30))
    assert timeline.dropped == 20 and trace["otherData"]["dropped_events"] == 20
    with pytest.raises(RuntimeError, match="closed"):
        timeline.save()

    in_memory = Timeline(max_buffered=5)
    for i in range(12):
        in_memory.instant("tick", lane="b", i=i)
    assert [e["args"]["i"] for e in in_memory.events()] == [7, 8, 9, 10, 11]
    assert in_memory.dropped == 7
    saved = json.load(open(in_memory.save(tmp_path / "mem.json")))
    assert len([e for e in saved["traceEvents"] if e["ph"] == "i"]) == 5


def test_disabled_timeline_records_nothing(tmp_path):
    timeline = Timeline(tmp_path / "off.json", enabled=False)
    with timeline.span("x"):
        pass
    timeline.instant("y")
    assert timeline.events() == []


def test_tensorboard_writer_does_not_drag_in_torch(tmp_path):
    import subprocess
    import sys

    code = ("import sys\nfrom areal_jax.metrics import MetricsLogger\n"
            f"MetricsLogger({str(tmp_path / 'r')!r}, enabled=True).log(1, {{'a': 1.0}})\n"
            "print('torch' in sys.modules, sys.modules.get('torch', 0) is None)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(
                             os.path.abspath(__file__)))))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]
