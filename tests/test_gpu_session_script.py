"""benchmarks/gpu_session.sh, run with a stand-in for python that only records its arguments: every phase runs,
and every benchmark command it would start on a GPU parses with that benchmark's own argument parser (flags,
choices and the checks each parse_args makes). A GPU lease is short; a typo must not cost one."""
from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHASES = ("flash", "trainer05", "sampler05", "handoff", "goals", "ragged", "followup", "followup_loop", "trainer15", "loop05", "lora15", "sampler_more",
          "memory05", "trainer_long", "checkpoint05", "moe", "replay", "granitemoe", "gptoss20b", "deepseek",
          "staleness", "hybrid")
RECORDER = """#!/bin/sh
printf '%s\\037' "$@" >> "$RECORD"
printf '\\n' >> "$RECORD"
"""


def recorded_commands(tmp_path, phases):
    recorder = tmp_path / "py"
    recorder.write_text(RECORDER)
    recorder.chmod(0o755)
    record = tmp_path / "argv"
    env = dict(os.environ, PY=str(recorder), RECORD=str(record), OUT=str(tmp_path / "out"),
               WORK=str(tmp_path / "work"), PATH=os.environ["PATH"])
    out = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_session.sh"), *phases], env=env,
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return [line.split("\x1f")[:-1] for line in record.read_text().splitlines()]


def test_every_phase_runs_and_every_benchmark_command_parses(tmp_path, monkeypatch):
    commands = recorded_commands(tmp_path, PHASES)
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    parsed = []
    for argv in commands:
        if argv[:1] in (["-"], ["-c"]):  # the inline flash check and the environment line
            continue
        if argv[:2] == ["-m", "pytest"]:  # tests run on the GPU: their files and test functions exist
            named = [a for a in argv[2:] if a.startswith("tests/")]
            for arg in named:
                path, _, name = arg.partition("::")
                assert os.path.isfile(os.path.join(ROOT, path)), arg
                assert not name or f"def {name}(" in open(os.path.join(ROOT, path)).read(), arg
            assert named
            parsed.append("pytest")
            continue
        if argv[0] == "-m":
            module, args = importlib.import_module(argv[1]), argv[2:]
        else:
            assert argv[0].startswith("benchmarks/") and argv[0].endswith(".py"), argv
            module, args = importlib.import_module(os.path.basename(argv[0])[:-3]), argv[1:]
        try:
            module.parse_args(args)
        except SystemExit as e:  # argparse's error: name the command
            pytest.fail(f"{' '.join(argv)} does not parse (exit {e.code})")
        parsed.append(argv[0] if argv[0] != "-m" else argv[1])
    want = {"benchmarks/trainer.py", "benchmarks/trace_top.py", "benchmarks/sampler.py", "benchmarks/handoff.py",
            "benchmarks/loop.py", "areal_jax.programs.report", "benchmarks/lora.py", "benchmarks/decode_attention.py",
            "benchmarks/staleness_ablation.py", "benchmarks/trainer_memory.py", "benchmarks/sampler_memory.py",
            "benchmarks/checkpoint.py", "benchmarks/moe.py", "benchmarks/router_replay.py", "benchmarks/paged_pieces.py",
            "benchmarks/mla_prefill.py", "benchmarks/page_budget.py", "benchmarks/sampling_head.py", "benchmarks/delta_rule.py",
            "benchmarks/ragged_decode.py", "benchmarks/adam_moments.py", "benchmarks/goals_report.py", "pytest"}
    assert set(parsed) == want and len(parsed) >= 20


def test_default_phases_and_an_unknown_phase(tmp_path):
    names = {argv[0] for argv in recorded_commands(tmp_path, ()) if argv[0].startswith("benchmarks/")}
    assert names == {"benchmarks/trainer.py", "benchmarks/trace_top.py", "benchmarks/sampler.py",
                     "benchmarks/handoff.py"}
    out = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_session.sh"), "nosuch"], timeout=60,
                         env=dict(os.environ, PY=sys.executable, OUT=str(tmp_path / "o"), WORK=str(tmp_path / "w")),
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 2 and "unknown phase nosuch" in out.stdout


def test_a_step_keeps_its_last_json_line_even_when_a_crash_follows(tmp_path):
    # A stand-in python that prints a JSON line, then dies as a profiler-trace crash would: the result line is the
    # JSON one, not the crash's last words; a step that prints no JSON gets a stub naming it and its exit code.
    fake = tmp_path / "py"
    fake.write_text('#!/bin/sh\ncase "$*" in *--host-only*) echo "no json here"; exit 3;; esac\n'
                    'echo \'{"figure": 1}\'\necho "Fatal Python error: Segmentation fault"\nexit 139\n')
    fake.chmod(0o755)
    env = dict(os.environ, PY=str(fake), OUT=str(tmp_path / "out"), WORK=str(tmp_path / "work"))
    subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_session.sh"), "handoff"], env=env, timeout=120,
                   capture_output=True, text=True, cwd=ROOT)
    lines = (tmp_path / "out" / "results.jsonl").read_text().splitlines()
    assert lines == ['{"figure": 1}', '{"step": "handoff05_host", "exit": 3, "json": null}']
