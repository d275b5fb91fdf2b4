"""``refengine bench``: async vs reference tokens/s on the default workload, side by side in one run.

Both engines get the same prompts and must produce the same tokens (checked); they run
alternately, ``--repeat`` times each, and the report gives the median of each and their ratio.
``--profile DIR`` runs the async engine once more under torch.profiler and writes DIR/async-trace.json,
a Chrome trace (open it in Perfetto, ui.perfetto.dev) with a named range per stage of every step
(STAGE_RANGES) on threads named for what they do (the host's scheduling thread, the CPU device
timeline's worker): how the host's stages overlap the device's programs. The aten ops under the ranges
(a hundred times the events: ~75 MB for one run of the default workload) are kept with ``--profile-ops``.
``--fake-cuda`` measures the async engine's host cost per step instead, by stage, with every launch a
GPU would see counted by name, on a machine without one (``refengine.tools.host_bench``).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from pathlib import Path

from refengine.config import DEFAULT_ASYNC_GRAPH_MODE
from refengine.tools.default_workload import bench_workload
from refengine.tools.errors import OneLineParser, add_dtype_flag, int_at_least


def _timed(llm, prompts, params) -> tuple[float, list]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - start, outs


def _sync(device: str) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _kernel_launches(llm, prompts, params) -> int | None:
    """CUDA kernels launched by one run of the workload (None off CUDA), from torch's profiler."""
    import torch

    if torch.device(llm.config.device).type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params)
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


# The ranges of a profiled step: (range name, object path from the engine, method). "schedule", "stage"
# and "process" run on the host; "program" is the step's work on the device timeline (the stream's thread
# on CPU; on CUDA the host's launch of it, the kernels below it).
STAGE_RANGES = (
    ("schedule", "core.scheduler", "schedule"),
    ("stage", "planner", "plan"),
    ("program", "runner", "_execute"),
    ("process", "", "process"),
)
TRACE_FILE = "async-trace.json"
# Trace events kept without --profile-ops: the stage ranges, the device's own work on CUDA (kernels,
# copies) and the trace's metadata; aten ops, CUDA runtime calls and their flow arrows are dropped.
KEPT_CATEGORIES = frozenset({"user_annotation", "gpu_user_annotation", "kernel", "gpu_memcpy", "gpu_memset",
                             "Trace"})
HOST_THREAD = "host: schedule, stage, process"
DEVICE_THREAD = "device: step programs (CPU device timeline)"


@contextlib.contextmanager
def stage_ranges(engine):
    """Wrap each STAGE_RANGES method of this engine instance in a profiler range (restored after; other
    instances are untouched)."""
    from torch.profiler import record_function

    wrapped = []
    try:
        for name, path, method in STAGE_RANGES:
            owner = engine
            for part in filter(None, path.split(".")):
                owner = getattr(owner, part)
            original = getattr(owner, method)

            def ranged(*args, _fn=original, _name=name, **kwargs):
                with record_function(_name):
                    return _fn(*args, **kwargs)

            own = vars(owner).get(method)  # an attribute of the instance itself, restored as it was
            setattr(owner, method, ranged)
            wrapped.append((owner, method, own))
        yield
    finally:
        for owner, method, own in wrapped:
            if own is None:
                delattr(owner, method)  # the class's method shows again
            else:
                setattr(owner, method, own)


def tidy_trace(path: Path, thread_names: dict[int, str], ops: bool = False) -> None:
    """Rewrite a Chrome trace: its threads named (``thread_names``: thread id -> name; the profiler calls
    each of them "thread N (python)"), and without ``ops`` only the KEPT_CATEGORIES events."""
    import json

    trace = json.loads(path.read_text())
    events = []
    for e in trace["traceEvents"]:
        if e.get("ph") == "M" and e.get("name") == "thread_name" and e.get("tid") in thread_names:
            e = {**e, "args": {**e.get("args", {}), "name": thread_names[e["tid"]]}}
        elif not ops and e.get("ph") != "M" and "cat" in e and e["cat"] not in KEPT_CATEGORIES:
            continue
        events.append(e)
    trace["traceEvents"] = events
    path.write_text(json.dumps(trace))


def profile_async(fast, copies: int, out_dir: str | Path, ops: bool = False) -> Path:
    """One run of the workload on the async engine under torch.profiler, every thread profiled (the CPU
    device timeline is a thread of its own), written as a Chrome trace with the stage ranges on named
    threads (the aten ops too with ``ops``); returns its path."""
    import threading

    import torch
    from torch.profiler import ProfilerActivity, profile

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    prompts, params = bench_workload(fast, copies, seed=0)
    activities = [ProfilerActivity.CPU]
    if torch.device(fast.config.device).type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    options = {}
    config = getattr(getattr(torch._C, "_profiler", None), "_ExperimentalConfig", None)
    with contextlib.suppress(TypeError):  # a torch without it profiles the calling thread only
        options["experimental_config"] = config(profile_all_threads=True)
    with stage_ranges(fast.engine), profile(activities=activities, **options) as prof:
        fast.generate(prompts, params)
        _sync(fast.config.device)
    path = out / TRACE_FILE
    prof.export_chrome_trace(str(path))
    names = {threading.get_native_id(): HOST_THREAD}
    if fast.engine.stream.thread_id is not None:
        names[fast.engine.stream.thread_id] = DEVICE_THREAD
    tidy_trace(path, names, ops)
    return path


def engines(model: str | None, k: int, graph_mode: str, max_num_seqs: int, device: str = "cpu",
            dtype: str = "float32"):
    """The reference and the async engine on the same checkpoint and settings.

    The async engine's settings are checked before either loads, so a bad graph mode or device
    is reported before any work; the first load reports a bad checkpoint.
    """
    from refengine import LLM
    from refengine.config import EngineConfig, SchedulerConfig, SpeculativeConfig
    from refengine.tools.tiny_models import resolve_tiny

    EngineConfig(engine="async", graph_mode=graph_mode, device=device,
                 dtype="float32" if dtype == "auto" else dtype,  # auto: resolved by LLM from the checkpoint
                 scheduler=SchedulerConfig(max_num_seqs=max_num_seqs),
                 speculative=SpeculativeConfig(num_speculative_tokens=k))
    common = {"model": resolve_tiny(model), "num_speculative_tokens": k, "max_num_seqs": max_num_seqs,
              "device": device, "dtype": dtype}
    return LLM(engine="reference", **common), LLM(engine="async", graph_mode=graph_mode, **common)


def run(model: str | None, k: int, graph_mode: str, repeat: int, copies: int, max_num_seqs: int,
        device: str = "cpu", dtype: str = "float32") -> dict:
    ref, fast = engines(model, k, graph_mode, max_num_seqs, device, dtype)
    return measure(ref, fast, repeat, copies)


def measure(ref, fast, repeat: int, copies: int) -> dict:
    import torch

    device = fast.config.device
    prompts, params = bench_workload(ref, copies, seed=0)
    for llm in (ref, fast):  # warm-up; on CUDA the whole workload, so every graph is captured before timing
        llm.generate(prompts if torch.device(device).type == "cuda" else prompts[:2], params)
    times = {"reference": [], "async": []}
    host_busy = []  # per async run: the share of wall time the host was not blocked on the device
    device_busy = []  # per async run: device time of the step programs over wall time
    step_us = []  # per async run: wall microseconds per step
    host_us = []  # per async run: host microseconds per step not spent blocked on the device
    outputs = {}
    stream, stats = fast.engine.stream, fast.engine.stats
    for _ in range(repeat):
        for name, llm in (("reference", ref), ("async", fast)):
            waited, busy, steps = stream.host_wait_seconds, stream.busy_seconds(), stats.steps
            elapsed = stats.elapsed
            _sync(device)
            dt, outs = _timed(llm, prompts, params)
            _sync(device)
            times[name].append(dt)
            outputs[name] = [o.token_ids for o in outs]
            if name == "async":
                host_busy.append(1.0 - (stream.host_wait_seconds - waited) / dt)
                device_busy.append((stream.busy_seconds() - busy) / dt)
                step_us.append(1e6 * dt / max(stats.steps - steps, 1))
                host = (stats.elapsed - elapsed) - (stream.host_wait_seconds - waited)
                host_us.append(1e6 * host / max(stats.steps - steps, 1))
    if outputs["reference"] != outputs["async"]:
        raise SystemExit("bench: the engines disagree on the workload's tokens; fix that first")
    steps_before = stats.steps
    launches = _kernel_launches(fast, prompts, params)
    launches_per_step = None if launches is None else launches / max(stats.steps - steps_before, 1)
    tokens = sum(len(t) for t in outputs["reference"])
    stats = fast.engine.stats
    tps = {name: tokens / statistics.median(ts) for name, ts in times.items()}
    return {
        "requests": len(prompts), "tokens": tokens, "tokens_per_s": tps, "dtype": fast.config.dtype,
        "ratio": tps["async"] / tps["reference"],
        "async_syncs_per_step": stats.syncs_per_step(fast.engine.stream.num_host_waits),
        "async_wasted_tokens": stats.wasted_tokens, "async_graph_steps": dict(stats.graph_steps),
        "async_row_moves": stats.row_moves, "async_host_busy": statistics.median(host_busy),
        "async_device_busy": statistics.median(device_busy), "async_us_per_step": statistics.median(step_us),
        "async_host_us_per_step": statistics.median(host_us),
        "async_launches_per_step": launches_per_step,
    }


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="refengine bench", description=__doc__)
    p.add_argument("--model", default=None)
    p.add_argument("--num-spec-tokens", dest="num_speculative_tokens", type=int_at_least(0), default=3)
    p.add_argument("--graph-mode", default=DEFAULT_ASYNC_GRAPH_MODE,
                   help=f"the async engine's graph mode (default {DEFAULT_ASYNC_GRAPH_MODE}, as everywhere)")
    p.add_argument("--repeat", type=int_at_least(1), default=3)
    p.add_argument(
        "--copies", type=int_at_least(1), default=1, help="repeat the default prompts this many times"
    )
    p.add_argument("--max-num-seqs", type=int_at_least(1), default=16)
    p.add_argument(
        "--threads", type=int_at_least(1), default=1, help="torch intra-op threads (default 1: small models)"
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (both engines)")
    p.add_argument("--profile", metavar="DIR", default=None, help=f"also profile one async run and write "
                   f"DIR/{TRACE_FILE} (Chrome trace, opens in Perfetto) with a range per stage: "
                   f"{', '.join(name for name, _, _ in STAGE_RANGES)}")
    p.add_argument("--profile-ops", action="store_true", help="with --profile: keep every aten op under the "
                   "ranges in the trace too (about a hundred times the events)")
    p.add_argument("--fake-cuda", action="store_true", help="measure the async engine's host cost per step "
                   "instead, by stage, on fake CUDA (no GPU, no kernel time), with its launches by name")
    p.add_argument("--json", action="store_true", help="with --fake-cuda: the figures as one JSON line")
    add_dtype_flag(p, "both engines")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    from refengine.tools.errors import SETUP_ERRORS, report

    torch.set_num_threads(args.threads)
    if args.fake_cuda:
        if args.device != "cpu" or args.profile is not None:
            return report("refengine bench", ValueError("--fake-cuda runs on the CPU alone, without --device "
                                                        "or --profile"))
        from refengine.tools import host_bench

        try:
            return host_bench.main(args)
        except SETUP_ERRORS as e:
            return report("refengine bench", e)
    if args.profile is not None and Path(args.profile).exists() and not Path(args.profile).is_dir():
        return report("refengine bench", ValueError(f"--profile {args.profile} is a file; name a folder"))
    try:
        ref, fast = engines(
            args.model,
            args.num_speculative_tokens,
            args.graph_mode,
            args.max_num_seqs,
            args.device,
            args.dtype,
        )
    except SETUP_ERRORS as e:
        return report("refengine bench", e)
    r = measure(ref, fast, args.repeat, args.copies)
    print(
        f"workload: {r['requests']} requests, {r['tokens']} generated tokens, "
        f"K={args.num_speculative_tokens}, "
        f"graph mode {args.graph_mode}, device {args.device}, dtype {r['dtype']} (both engines), "
        f"torch threads {torch.get_num_threads()}"
    )
    for name, tps in r["tokens_per_s"].items():
        print(f"  {name:9s} {tps:8.1f} tokens/s (median of {args.repeat})")
    print(f"  ratio async/reference: {r['ratio']:.2f}x")
    print(
        f"  async, totals over the warm-up and {args.repeat} timed runs: {r['async_syncs_per_step']:.2f} "
        f"host syncs per step, {r['async_wasted_tokens']} wasted tokens, {r['async_row_moves']} row moves, "
        f"graph steps {r['async_graph_steps']}"
    )
    busy = r["async_host_busy"]
    print(
        f"  async host busy {100 * busy:.1f}% of the run (the rest blocked on the device): overlapping host "
        f"work with the device can gain at most {1 / max(1.0 - busy, 1e-9):.2f}x here"
    )
    launches = r["async_launches_per_step"]
    print(
        f"  async device busy {100 * r['async_device_busy']:.1f}% of the run (device time of the step "
        f"programs over wall time), {r['async_us_per_step']:.0f} us per step, "
        f"{r['async_host_us_per_step']:.0f} us host time per step, "
        + (
            "kernel launches per step n/a (CUDA only)"
            if launches is None
            else f"{launches:.1f} kernel launches per step"
        )
    )
    if args.profile is not None:
        path = profile_async(fast, args.copies, args.profile, ops=args.profile_ops)
        print(f"  profile of one async run: {path} (Chrome trace: open it in Perfetto, ui.perfetto.dev); "
              f"ranges {', '.join(name for name, _, _ in STAGE_RANGES)} per step")
    return 0
