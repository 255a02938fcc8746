"""The profiling skills (capture-nsys-profile, analyze-nsys-profile, profile-kernel) and the NVTX
ranges and capture window they rely on."""

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from cli_util import run_script, write_config
from conftest import tiny_config
from dist_util import run_fn


def _nvtx_names_of_runs(rank, world, jobs):
    """Each job trained with NVTX requested and a CUDA build pretended (the NVTX range recorded,
    not called): the range names it opened, and the ranges still open at the end."""
    import torch

    from pithtrain import protocol
    from pithtrain.parallel.mesh import init_mesh
    from pithtrain.train.loop import train

    opened, depth = [], [0]

    @contextlib.contextmanager
    def record(name):
        opened[-1].add(name)
        depth[0] += 1
        yield
        depth[0] -= 1

    protocol.NVTX = True
    torch.cuda.is_available = lambda: True
    torch.cuda.nvtx.range = record
    out = []
    for config, out_dir in jobs:
        opened.append(set())
        p = config.parallel
        train(config, out_dir, echo=False, mesh=init_mesh(p.pp, p.cp, p.ep, "cpu", p.timeout_s, p.hsdp))
        out.append((sorted(opened[-1]), depth[0]))
    return out


@pytest.mark.fast
def test_nvtx_ranges_name_the_stages_collectives_and_optimizer(tmp_path, dataset_dir):
    """Under PITHTRAIN_NVTX=1, a two-rank expert-parallel run opens the ranges the analysis reads:
    the five stages, dispatch and combine (forward and backward), the optimizer; the overlapped
    (DualPipeV) schedule as well, with its deferred expert weight gradients; every range closed."""
    plain = tiny_config(dataset_dir, steps=1, device="cpu", checkpoint_every=-1)  # saving asks CUDA
    plain.parallel.ep, plain.parallel.overlap_ep = 2, False
    overlapped = tiny_config(dataset_dir, steps=1, device="cpu", checkpoint_every=-1, micro_batch_size=2)
    overlapped.parallel.ep = 2
    ranks = run_fn(2, _nvtx_names_of_runs, [(plain, tmp_path / "plain"), (overlapped, tmp_path / "overlapped")])
    stages = [f"pithtrain::stage{n}" for n in range(1, 6)]
    comms = ["pithtrain::combine", "pithtrain::combine.backward", "pithtrain::dispatch", "pithtrain::dispatch.backward"]
    for (plain_names, plain_open), (over_names, over_open) in ranks:
        assert plain_names == sorted(comms + ["pithtrain::optimizer"] + stages), plain_names
        assert over_names == sorted(comms + ["pithtrain::optimizer"] + stages + ["pithtrain::stage3.wgrad"]), over_names
        assert plain_open == over_open == 0


@pytest.mark.fast
def test_nvtx_is_off_by_default_and_on_a_cpu_build():
    from pithtrain import protocol

    assert not protocol.NVTX  # the test process has no PITHTRAIN_NVTX
    assert isinstance(protocol.stage_range(1), contextlib.nullcontext)


@pytest.mark.fast
def test_profile_steps_window_is_checked_before_training(tmp_path, dataset_dir, monkeypatch):
    from pithtrain.config import UserError
    from pithtrain.train.loop import cuda_profiler_steps, train

    monkeypatch.setenv("PITHTRAIN_PROFILE_STEPS", "3:4")
    assert cuda_profiler_steps() == (3, 4)
    for bad in ("4:3", "0:2", "3", "a:b"):
        monkeypatch.setenv("PITHTRAIN_PROFILE_STEPS", bad)
        with pytest.raises(UserError, match="PITHTRAIN_PROFILE_STEPS"):
            train(tiny_config(dataset_dir, steps=1), tmp_path / bad.replace(":", "_"), echo=False)
        assert not (tmp_path / bad.replace(":", "_")).exists()


ANALYZE = ".agents/skills/analyze-nsys-profile/analyze_nsys.py"
PID = 4242
MAIN, AUTOGRAD = (PID << 24) | 1, (PID << 24) | 2  # nsys's globalTid: the pid above bit 24, the tid below


def _nsys_sqlite(path, stage5=True, stage4=True):
    """An export with nsys's schema (the columns the analysis reads, named as nsys names them) and
    known times in microseconds: host ranges and launches on two threads, kernels on two streams."""
    import sqlite3

    us = 1000  # the export's unit is ns
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT NOT NULL);
        CREATE TABLE NVTX_EVENTS (start INTEGER NOT NULL, end INTEGER, eventType INTEGER NOT NULL, rangeId INTEGER,
            category INTEGER, color INTEGER, text TEXT, globalTid INTEGER, endGlobalTid INTEGER, textId INTEGER,
            domainId INTEGER, uint64Value INTEGER, int64Value INTEGER, doubleValue REAL, uint32Value INTEGER,
            int32Value INTEGER, floatValue REAL, jsonTextId INTEGER, jsonText TEXT);
        CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME (start INTEGER NOT NULL, end INTEGER NOT NULL, eventClass INTEGER NOT NULL,
            globalTid INTEGER, correlationId INTEGER, nameId INTEGER NOT NULL, returnValue INTEGER NOT NULL, callchainId INTEGER);
        CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INTEGER NOT NULL, end INTEGER NOT NULL, deviceId INTEGER NOT NULL,
            contextId INTEGER NOT NULL, streamId INTEGER NOT NULL, correlationId INTEGER, globalPid INTEGER,
            demangledName INTEGER NOT NULL, shortName INTEGER NOT NULL, mangledName INTEGER, gridX INTEGER NOT NULL,
            gridY INTEGER NOT NULL, gridZ INTEGER NOT NULL, blockX INTEGER NOT NULL, blockY INTEGER NOT NULL,
            blockZ INTEGER NOT NULL);
    """)
    names = ["cudaLaunchKernel", "gemm", "count_ids", "ncclDevKernel_SendRecv", "vectorized_elementwise",
             "multi_tensor_apply_adam", "pithtrain::stage3.wgrad"]
    db.executemany("INSERT INTO StringIds VALUES (?, ?)", enumerate(names))
    ranges = [(0, 100, "pithtrain::stage1"), (100, 200, "pithtrain::stage2"), (150, 190, "pithtrain::dispatch"),
              (200, 300, "pithtrain::stage3"), (300, 400, "pithtrain::stage4"), (310, 390, "pithtrain::combine"),
              (600, 700, "pithtrain::optimizer"), (0, 1000, "not ours"),
              (820, 880, "pithtrain::stage1")]  # while the autograd thread launches in its wgrad range
    if stage5:
        ranges.append((400, 500, "pithtrain::stage5"))
    if not stage4:  # one expert rank: the combine launches nothing, its range holds no kernel
        ranges = [r for r in ranges if r[2] not in ("pithtrain::stage4", "pithtrain::combine")]
    db.executemany("INSERT INTO NVTX_EVENTS (start, end, eventType, text, globalTid) VALUES (?, ?, 59, ?, ?)",
                   [(a * us, b * us, name, MAIN) for a, b, name in ranges])
    # a registered string (textId), on the autograd thread; a mark (eventType 34) is not a range
    db.execute("INSERT INTO NVTX_EVENTS (start, end, eventType, textId, globalTid) VALUES (?, ?, 59, 6, ?)",
               (800 * us, 900 * us, AUTOGRAD))
    db.execute("INSERT INTO NVTX_EVENTS (start, end, eventType, text, globalTid) VALUES (?, NULL, 34, 'pithtrain::stage1', ?)",
               (10 * us, MAIN))
    # (launch time, thread, kernel name id, stream, kernel start, end): correlation ids 1..9
    kernels = [(10, MAIN, 1, 7, 1000, 2000), (120, MAIN, 2, 7, 2000, 2500), (160, MAIN, 3, 13, 2500, 4500),
               (210, MAIN, 1, 7, 3000, 6000), (320, MAIN, 3, 13, 6000, 8000), (410, MAIN, 4, 7, 8000, 8500),
               (650, MAIN, 5, 7, 10000, 11000), (11500, MAIN, 4, 7, 12000, 12500), (850, AUTOGRAD, 1, 7, 13000, 14000)]
    for corr, (launch, tid, name, stream, a, b) in enumerate(kernels, 1):
        db.execute("INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME VALUES (?, ?, 0, ?, ?, 0, 0, NULL)", (launch * us, launch * us + 5 * us, tid, corr))
        db.execute("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?, ?, 0, 1, ?, ?, ?, ?, ?, ?, 1, 1, 1, 128, 1, 1)",
                   (a * us, b * us, stream, corr, PID << 24, name, name, name))
    # a kernel whose launch was not captured (correlation id 99): outside ranges
    db.execute("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?, ?, 0, 1, 7, 99, ?, 4, 4, 4, 1, 1, 1, 128, 1, 1)",
               (15000 * us, 15250 * us, PID << 24))
    db.commit()
    db.close()
    return path


@pytest.mark.fast
def test_analyze_nsys_profile_attributes_time_overlap_and_gaps(tmp_path):
    """Known figures: each kernel to the innermost range open at its launch on its thread
    (dispatch and combine inside stages 2 and 4, the wgrad range on the autograd thread); NCCL
    4 ms of which 1.5 ms under the stage-3 GEMM; four idle gaps charged to the range of the launch
    that ended them (none known: outside), one of them while the host had not launched it yet."""
    db = _nsys_sqlite(tmp_path / "run.sqlite")
    out = subprocess.run([sys.executable, ANALYZE, str(db)], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip().endswith("PASS: 1 process(es) with GPU time in layer stages 1, 2, 3, 5 and the optimizer"), out.stdout + out.stderr
    text = out.stdout
    assert f"process {PID} (device 0): 10 GPU activities, 11.75 ms, first to last 14.25 ms" in text, text
    for ms, share, name in [(3.0, 25.5, "pithtrain::stage3"), (2.0, 17.0, "pithtrain::dispatch"),
                            (2.0, 17.0, "pithtrain::combine"), (1.0, 8.5, "pithtrain::stage1"),
                            (1.0, 8.5, "pithtrain::optimizer"), (1.0, 8.5, "pithtrain::stage3.wgrad"),
                            (0.75, 6.4, "(outside ranges)"), (0.5, 4.3, "pithtrain::stage2"), (0.5, 4.3, "pithtrain::stage5")]:
        assert f"{ms:9.2f}  {share:5.1f}%  {name}\n" in text, (name, text)
    assert "not ours" not in text and "pithtrain::stage4\n" not in text
    assert ("by layer stage, ranges nested in a stage included (ms): stage 1 1.00, stage 2 2.50, stage 3 3.00, "
            "stage 4 2.00, stage 5 0.50, stage 3 wgrad 1.00, optimizer 1.00") in text, text
    assert "NCCL 4.00 ms, overlapped with compute: 37.5%" in text, text
    assert "all-to-all/p2p      4.00 ms,  37.5% overlapped" in text, text
    assert "GPU idle (gaps >= 20 us, nothing on any stream): 4.00 ms in 4 gaps, 1.00 ms of it before the host" in text, text
    idle = text.split("GPU idle")[1]
    assert "     1.50  pithtrain::optimizer" in idle and "     2.00  (outside ranges)" in idle, idle
    assert "     0.50  pithtrain::stage3.wgrad" in idle, idle


@pytest.mark.fast
def test_analyze_nsys_profile_fails_clearly(tmp_path):
    """A stage without GPU time, an overlap under the bar, a capture without our ranges, no file; an
    empty stage 4 (one expert rank: the combine moves nothing) passes."""
    def analyze(*args):
        return subprocess.run([sys.executable, ANALYZE, *map(str, args)], capture_output=True, text=True)

    no_stage5 = analyze(_nsys_sqlite(tmp_path / "a.sqlite", stage5=False))
    assert no_stage5.returncode == 1, no_stage5.stdout
    assert no_stage5.stdout.strip().splitlines()[-1] == f"FAIL: process {PID}: no GPU time in stage 5", no_stage5.stdout
    no_stage4 = analyze(_nsys_sqlite(tmp_path / "c.sqlite", stage4=False), "--min-overlap", "0")
    assert no_stage4.returncode == 0 and no_stage4.stdout.strip().splitlines()[-1] == "PASS: 1 process(es) with GPU time in layer stages 1, 2, 3, 5 and the optimizer", no_stage4.stdout
    low = analyze(_nsys_sqlite(tmp_path / "b.sqlite"), "--min-overlap", "0.5")
    assert low.returncode == 1 and low.stdout.strip().endswith(f"FAIL: process {PID}: NCCL overlap 37.5% < 50%"), low.stdout
    import sqlite3

    db = sqlite3.connect(tmp_path / "b.sqlite")
    db.execute("DELETE FROM NVTX_EVENTS")
    db.commit()
    db.close()
    bare = analyze(tmp_path / "b.sqlite")
    assert bare.returncode == 1 and "PITHTRAIN_NVTX=1" in bare.stdout, bare.stdout
    gone = analyze(tmp_path / "none.sqlite")
    assert gone.returncode == 1 and "nsys export --type sqlite" in gone.stdout, gone.stdout
    folder = analyze(tmp_path)  # a capture's folder: the export in it is named, or the command to make one from its capture
    assert folder.returncode == 1 and folder.stdout.strip() == (
        f"FAIL: {tmp_path} is a directory, not the SQLite export of a capture (give {tmp_path / 'a.sqlite'})"), folder.stdout
    (tmp_path / "cap").mkdir()
    (tmp_path / "cap" / "step.nsys-rep").touch()
    capture = analyze(tmp_path / "cap")
    rep = tmp_path / "cap" / "step"
    assert capture.returncode == 1 and capture.stdout.strip().endswith(
        f"(make it: nsys export --type sqlite -o {rep}.sqlite {rep}.nsys-rep)"), capture.stdout


@pytest.mark.fast
def test_analyze_nsys_profile_names_what_an_export_lacks(tmp_path):
    """A table or a column the analysis reads that the export lacks, a file that is no SQLite database: one
    FAIL line naming it. No NCCL kernel under --min-overlap: said so. Thresholds out of range: argparse's error."""
    import sqlite3

    def analyze(*args):
        return subprocess.run([sys.executable, ANALYZE, *map(str, args)], capture_output=True, text=True)

    for name, change in (("runtime", "DROP TABLE CUPTI_ACTIVITY_KIND_RUNTIME"), ("column", "ALTER TABLE CUPTI_ACTIVITY_KIND_KERNEL DROP COLUMN shortName"),
                         ("nccl", "UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET demangledName = 1, shortName = 1 WHERE demangledName = 3")):
        db = sqlite3.connect(_nsys_sqlite(tmp_path / f"{name}.sqlite"))
        db.execute(change)
        db.commit()
        db.close()
    (tmp_path / "text.sqlite").write_text("not a database\n")
    for args, says in [([tmp_path / "runtime.sqlite"], f"{tmp_path / 'runtime.sqlite'} has no table CUPTI_ACTIVITY_KIND_RUNTIME ("),
                       ([tmp_path / "column.sqlite"], f"{tmp_path / 'column.sqlite'}: no such column: k.shortName; expected an nsys"),
                       ([tmp_path / "text.sqlite"], f"{tmp_path / 'text.sqlite'}: file is not a database; expected an nsys"),
                       ([tmp_path / "nccl.sqlite", "--min-overlap", 0.5], f"process {PID}: no NCCL kernels (--min-overlap 50%)")]:
        out = analyze(*args)
        assert out.returncode == 1 and out.stdout.strip().splitlines()[-1].startswith(f"FAIL: {says}"), (args, out.stdout + out.stderr)
    for flag, value in (("--min-overlap", "nan"), ("--min-overlap", 2), ("--gap-us", -5)):
        out = analyze(tmp_path / "nccl.sqlite", flag, value)
        assert out.returncode == 2 and f"argument {flag}: " in out.stderr.splitlines()[-1], out.stderr


CAPTURE = ".agents/skills/capture-nsys-profile/capture_nsys.py"

# Stands in for Nsight Systems on the CPU: `profile` records the environment it got, runs the
# program after its options and writes the report; `export` copies a prepared SQLite export.
FAKE_NSYS = """#!/bin/sh
if [ "$1" = profile ]; then
    shift; report=""
    while [ "${1#--}" != "$1" ]; do case "$1" in --output=*) report="${1#--output=}";; esac; shift; done
    echo "$PITHTRAIN_NVTX $PITHTRAIN_PROFILE_STEPS" > "$(dirname "$report")/env.txt"
    "$@" && touch "$report"
elif [ "$1" = export ]; then
    for a in "$@"; do case "$a" in --output=*) cp "$FAKE_SQLITE" "${a#--output=}";; esac; done
fi
"""


def test_capture_nsys_profile_runs_exports_and_analyses(tmp_path, dataset_dir):
    """A real tiny run through the command line the script builds (nsys stood in for: the machines
    here have none): the run gets PITHTRAIN_NVTX=1 and the capture window, trains to its last
    step, and the verdict is the analysis of the export."""
    from conftest import write_run_file

    run = write_run_file(tmp_path / "run.py", dataset_dir)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nsys").write_text(FAKE_NSYS)
    (bin_dir / "nsys").chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
               FAKE_SQLITE=str(_nsys_sqlite(tmp_path / "export.sqlite")))
    out = subprocess.run([sys.executable, CAPTURE, str(run), "--capture", "2:3", "--out", str(tmp_path / "cap")],
                         capture_output=True, text=True, env=env)
    assert out.returncode == 0 and out.stdout.strip().endswith("PASS: 1 process(es) with GPU time in layer stages 1, 2, 3, 5 and the optimizer"), out.stdout + out.stderr
    assert "--capture-range=cudaProfilerApi" in out.stdout and "PITHTRAIN_PROFILE_STEPS=2:3" in out.stdout
    assert (tmp_path / "cap" / "env.txt").read_text().split() == ["1", "2:3"]
    steps = [json.loads(line)["step"] for line in (tmp_path / "cap" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    assert "by layer stage" in out.stdout  # the analysis ran on the export
    again = subprocess.run([sys.executable, CAPTURE, str(run), "--out", str(tmp_path / "cap")], capture_output=True, text=True, env=env)
    assert again.returncode == 1 and "exists" in again.stdout.splitlines()[-1]


@pytest.mark.fast
def test_capture_nsys_profile_without_nsys_says_what_to_install(tmp_path, dataset_dir, monkeypatch):
    (tmp_path / "tmp").mkdir()
    env = dict(os.environ, PATH=os.path.dirname(sys.executable), TMPDIR=str(tmp_path / "tmp"))  # python, but no nsys
    config = write_config(tmp_path / "c.py", dataset_dir)  # a dataset that exists: the run's data is checked first
    out = subprocess.run([sys.executable, CAPTURE, config, "--capture", "3:4", "--train-args", "--nproc 2 --ep 2"],
                         capture_output=True, text=True, env=env)
    lines = out.stdout.strip().splitlines()
    assert out.returncode == 1 and lines[-1].startswith("FAIL: nsys is not on PATH: install Nsight Systems"), out.stdout
    assert lines[0].startswith("$ PITHTRAIN_NVTX=1 PITHTRAIN_PROFILE_STEPS=3:4 nsys profile --trace=cuda,nvtx "), lines[0]
    assert lines[0].endswith("--steps 4 --nproc 2 --ep 2"), lines[0]
    assert not list((tmp_path / "tmp").glob("nsys-*"))  # was: an empty nsys-* directory left on every call
    bad = subprocess.run([sys.executable, CAPTURE, "examples/qwen3_tiny.py", "--capture", "4:3"], capture_output=True, text=True)
    assert bad.returncode == 1 and "FIRST:LAST" in bad.stdout
    # nsys there, the profiled run failing: the FAIL line names the temporary directory that keeps its files
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nsys").write_text('#!/bin/sh\nfor a in "$@"; do case "$a" in --output=*) echo failed > '
                                           '"$(dirname "${a#--output=}")/nsys.log";; esac; done\nexit 1\n')
    (tmp_path / "bin" / "nsys").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    failed = run_script(CAPTURE, config, "--capture", "1:1")
    [kept] = (tmp_path / "tmp").glob("nsys-*")  # was: named nowhere
    assert failed.returncode == 1 and failed.stdout.splitlines()[-1] == (
        f"FAIL: the profiled run did not finish (its error is above); its files are in {kept}"), failed.stdout
    assert (kept / "nsys.log").read_text() == "failed\n"


KERNEL = ".agents/skills/profile-kernel/profile_kernel.py"
METRIC_SM, METRIC_DRAM = "sm__throughput.avg.pct_of_peak_sustained_elapsed", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed"
NCU_HEAD = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
            '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')


def _ncu_csv(path, kernels):
    """ncu --csv output: ==PROF== lines around one row per (kernel launch, metric)."""
    rows = [f'"{i}","77","python","h","{name}","1","7","(128, 1, 1)","(264, 1, 1)","0","9.0","Command line profiler metrics",'
            f'"{metric}","{unit}","{value}"' for i, (name, metrics) in enumerate(kernels) for metric, unit, value in metrics]
    path.write_text("==PROF== Connected to process 77 (python)\n" + NCU_HEAD + "\n" + "\n".join(rows)
                    + "\n==PROF== Disconnected from process 77\n")
    return path


@pytest.mark.fast
def test_profile_kernel_roofline_of_an_ncu_csv(tmp_path):
    """A grouped GEMM: two kernels (units scaled and plain, thousands separators), 0.2 TFLOP in
    0.5 ms = 400 TFLOP/s, 150 MB of DRAM traffic: compute-bound at 51% of the measured 785;
    a row gather with no FLOPs: 300 MB in 0.1 ms = 3000 GB/s of the measured 4170."""
    gemm = _ncu_csv(tmp_path / "gemm.csv", [
        ("cumsum_kernel", [("gpu__time_duration.sum", "usecond", "2"), ("dram__bytes_read.sum", "Kbyte", "1"),
                           ("dram__bytes_write.sum", "byte", "1,000"),
                           ("sm__throughput.avg.pct_of_peak_sustained_elapsed", "%", "0.5"),
                           ("gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed", "%", "n/a")]),
        ("sm90_xmma_gemm_bf16", [("gpu__time_duration.sum", "nsecond", "498,000"), ("dram__bytes_read.sum", "byte", "99,999,000"),
                                 ("dram__bytes_write.sum", "Mbyte", "49.999"),
                                 ("sm__throughput.avg.pct_of_peak_sustained_elapsed", "%", "61.25"),
                                 ("gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed", "%", "7.5")])])

    def profile(csv_path, *args):
        return subprocess.run([sys.executable, KERNEL, "--csv", str(csv_path), *map(str, args)], capture_output=True, text=True)

    ok = profile(gemm, "--flops", 2e11, "--min-bytes", 1e8)
    assert ok.returncode == 0 and ok.stdout.strip().endswith("PASS: efficiency 51.0% >= 50% of the compute-bound roofline"), ok.stdout + ok.stderr
    assert "op: 2 kernel(s), 0.5000 ms, 200.00 GFLOP, DRAM 150.00 MB (1.50x the 100.00 MB it must move)" in ok.stdout, ok.stdout
    assert ("achieved 400.0 TFLOP/s (bf16 peak 785), 300 GB/s (HBM peak 4170); intensity 1333.3 FLOP/byte (2000.0 at "
            "the minimum bytes), ridge 188.2: compute-bound, roofline 785.0 TFLOP/s, efficiency 51.0%") in ok.stdout, ok.stdout
    assert "   0.4980        100.00     50.00   61.2     7.5  sm90_xmma_gemm_bf16" in ok.stdout, ok.stdout
    assert "   0.0020          0.00      0.00    0.5     nan  cumsum_kernel" in ok.stdout, ok.stdout  # n/a: not measured
    high = profile(gemm, "--flops", 2e11, "--min-bytes", 1e8, "--min-efficiency", 0.6)
    assert high.returncode == 1 and high.stdout.strip().splitlines()[-1].startswith(
        "FAIL: efficiency 51.0% < 60% (compute-bound below the roof: retile"), high.stdout
    spec = profile(gemm, "--flops", 2e11, "--min-bytes", 1e8, "--peaks", "spec")
    assert "ridge 206.0: compute-bound, roofline 989.0 TFLOP/s, efficiency 40.4%" in spec.stdout and spec.returncode == 1
    fp8 = profile(gemm, "--flops", 2e11, "--min-bytes", 1e8, "--dtype", "fp8")
    assert "(fp8 peak 1440)" in fp8.stdout and "efficiency 27.8%" in fp8.stdout, fp8.stdout
    gather = _ncu_csv(tmp_path / "gather.csv", [("move_rows_kernel", [
        ("gpu__time_duration.sum", "usecond", "100"), ("dram__bytes_read.sum", "Mbyte", "100"),
        ("dram__bytes_write.sum", "Mbyte", "200")])])
    moved = profile(gather, "--flops", 0, "--min-bytes", 2.5e8)
    assert moved.returncode == 0 and "3000 GB/s" in moved.stdout and "memory-bound" in moved.stdout, moved.stdout
    assert "efficiency 71.9%" in moved.stdout, moved.stdout
    slow = profile(gather, "--flops", 0, "--min-bytes", 2.5e8, "--min-efficiency", 0.8)
    assert slow.returncode == 1 and "FAIL: efficiency 71.9% < 80% (memory-bound: moves 1.2x its minimum bytes" in slow.stdout
    empty = profile(_ncu_csv(tmp_path / "none.csv", []), "--flops", 1, "--min-bytes", 1)
    assert empty.returncode == 1 and "ncu measured no kernel" in empty.stdout
    for missing, says in ((tmp_path / "absent.csv", "No such file"), (tmp_path, "Is a directory")):
        out = profile(missing)
        assert out.returncode == 1 and out.stdout.startswith(f"FAIL: --csv {missing}: cannot be read ({says}"), out.stdout
    for extra in (["grouped_mm"], ["--train", "examples/qwen3_tiny.py"], ["--min-bytes", 1e8]):  # were ignored: a verdict on the file alone
        assert run_script(KERNEL, "--csv", gemm, *extra).returncode == 2, extra
    (tmp_path / "other.csv").write_text("step,loss\n1,4.2\n")  # a CSV, but not ncu's: not "measured no kernel"
    other = profile(tmp_path / "other.csv")
    assert other.returncode == 1 and other.stdout.splitlines()[-1] == (f'FAIL: --csv {tmp_path / "other.csv"}: no ncu table in '
                                                                        'it (no "ID" header line); give the file `ncu --csv --log-file` wrote'), other.stdout


@pytest.mark.fast
def test_profile_kernel_driver_runs_each_op(tmp_path):
    """What ncu profiles, on the CPU paths at small shapes: each op runs, with its FLOPs and least bytes."""
    import argparse
    import importlib.util

    spec = importlib.util.spec_from_file_location("profile_kernel", KERNEL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    shape = dict(experts=4, rows=16, hidden=64, out_dim=96, tokens=32, device="cpu")
    expect = {"grouped_mm": (2 * 4 * 16 * 64 * 96, 2 * (4 * 16 * 64 + 4 * 64 * 96 + 4 * 16 * 96), (4 * 16, 96)),
              "fp8_grouped_mm": (2 * 4 * 16 * 64 * 96, 4 * 16 * 64 + 4 * 64 * 96 + 2 * 4 * 16 * 96 + 4 * (4 * 16 + 4 * 96), (4 * 16, 96)),
              "swiglu": (5 * 32 * 8 * 48, 2 * (32 * 8 * 96 + 32 * 8 * 48), (256, 48)),
              "permute": (0, 2 * (32 * 64 + 32 * 8 * 64) + 8 * 32 * 8, (256, 64))}
    for op in tool.OPS:
        call, flops, min_bytes, dtype = tool.build_op(argparse.Namespace(op=op, **shape), "cpu")
        assert (flops, min_bytes, dtype) == expect[op][:2] + ("fp8" if op.startswith("fp8") else "bf16",), op
        assert tuple(call().shape) == expect[op][2], op
    facts = tmp_path / "facts.json"
    assert tool.driver(argparse.Namespace(op="permute", facts=str(facts), **shape)) == 0
    assert json.loads(facts.read_text()) == {"flops": 0.0, "min_bytes": float(expect["permute"][1]), "dtype": "bf16"}


@pytest.mark.fast
def test_profile_kernel_without_ncu_says_where_it_is(tmp_path):
    env = dict(os.environ, PATH=os.path.dirname(sys.executable))
    out = subprocess.run([sys.executable, KERNEL, "grouped_mm"], capture_output=True, text=True, env=env)
    assert out.returncode == 1 and out.stdout.strip().startswith("FAIL: ncu is not on PATH"), out.stdout


@pytest.mark.fast
def test_profile_kernel_judges_a_runs_kernels_by_speed_of_light(tmp_path):
    """--train's report on an ncu CSV of a step's range: kernels grouped by name; a kernel with
    5% or more of the time under the bar FAILs, a short one does not."""
    def kernel(name, us, sm, dram_pct, mbytes):
        return (name, [("gpu__time_duration.sum", "usecond", str(us)), ("dram__bytes_read.sum", "Mbyte", str(mbytes)),
                       ("dram__bytes_write.sum", "byte", "0"),
                       ("sm__throughput.avg.pct_of_peak_sustained_elapsed", "%", str(sm)),
                       ("gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed", "%", str(dram_pct))])

    csv_path = _ncu_csv(tmp_path / "run.csv", [kernel("gemm", 60, 80, 10, 30), kernel("gemm", 20, 60, 10, 10),
                                               kernel("swiglu_fwd", 16, 10, 40, 48), kernel("tiny_copy", 4, 1, 2, 0.4)])
    out = subprocess.run([sys.executable, KERNEL, "--csv", str(csv_path)], capture_output=True, text=True)
    assert "4 kernel launches, 0.100 ms; by kernel" in out.stdout, out.stdout + out.stderr
    assert "     0.0800  80.0%     2x  75.0%     500  gemm" in out.stdout, out.stdout  # (60*80 + 20*60) / 80
    assert "     0.0160  16.0%     1x  40.0%    3000  swiglu_fwd" in out.stdout, out.stdout
    assert out.returncode == 1 and out.stdout.strip().endswith(
        "FAIL: under 50% of speed of light: swiglu_fwd (16% of the time at 40%)"), out.stdout
    ok = subprocess.run([sys.executable, KERNEL, "--csv", str(csv_path), "--min-efficiency", "0.4"], capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.strip().endswith(
        "PASS: every kernel with 5% or more of the time at >= 40% of speed of light"), ok.stdout


# Stands in for Nsight Compute: runs the program after its options, then writes an ncu CSV of one
# kernel to --log-file, and the environment the program got next to it.
FAKE_NCU = """#!{python}
import os, subprocess, sys
args, opts = sys.argv[1:], {{}}
while args[0].startswith("--"):
    key = args.pop(0)
    opts[key] = args.pop(0) if key not in ("--csv", "--nvtx") else True
code = subprocess.run(args).returncode
log = opts["--log-file"]
open(os.path.join(os.path.dirname(log), "env.txt"), "w").write(" ".join(
    [os.environ["PITHTRAIN_NVTX"], os.environ["PITHTRAIN_PROFILE_STEPS"], opts["--nvtx-include"], opts["--profile-from-start"]]))
open(log, "w").write({csv!r})
sys.exit(code)
"""


def test_profile_kernel_profiles_a_range_of_a_real_run(tmp_path, dataset_dir):
    """--train: the command line runs a real tiny training run to the chosen step, with NVTX on,
    the capture window on that step and ncu filtered to the range (ncu stood in for)."""
    from conftest import write_run_file

    rows = [f'"0","1","python","h","grouped_gemm","1","7","(128, 1, 1)","(8, 1, 1)","0","9.0","s","{m}","{u}","{v}"'
            for m, u, v in (("gpu__time_duration.sum", "ns", "5000"), ("dram__bytes_read.sum", "byte", "1000"),
                            ("dram__bytes_write.sum", "byte", "0"), (METRIC_SM, "%", "70"), (METRIC_DRAM, "%", "3"))]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ncu").write_text(FAKE_NCU.format(python=sys.executable, csv=NCU_HEAD + "\n" + "\n".join(rows) + "\n"))
    (bin_dir / "ncu").chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    run = write_run_file(tmp_path / "run.py", dataset_dir)
    out = subprocess.run([sys.executable, KERNEL, "--train", str(run), "--range", "stage3", "--step", "2"],
                         capture_output=True, text=True, env=env)
    assert out.returncode == 0 and out.stdout.strip().endswith(
        "PASS: every kernel with 5% or more of the time at >= 50% of speed of light"), out.stdout + out.stderr
    assert "     0.0050 100.0%     1x  70.0%       0  grouped_gemm" in out.stdout, out.stdout
    work = Path(out.stdout.split("--log-file ")[1].split()[0]).parent
    assert (work / "env.txt").read_text().split() == ["1", "2:2", "pithtrain::stage3/", "off"]
    steps = [json.loads(line)["step"] for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]


@pytest.mark.fast
def test_timeline_overlap_matches_pairwise_sums():
    """The shared one-pass overlap against the sum over all pairs, on random disjoint span sets."""
    import random

    sys.path.insert(0, ".agents/skills/_common")
    from timeline import gaps, merged, overlap_time

    rng = random.Random(0)
    for _ in range(300):
        def spans():
            return merged(sorted((x, x + rng.randint(1, 30)) for x in (rng.randint(0, 300) for _ in range(rng.randint(0, 15)))))

        a, b = spans(), spans()
        assert overlap_time(a, b) == sum(max(0, min(e, g) - max(s, f)) for s, e in a for f, g in b)
        assert sum(e - s for s, e in gaps(a, 0)) == (a[-1][1] - a[0][0] - sum(e - s for s, e in a) if a else 0)
